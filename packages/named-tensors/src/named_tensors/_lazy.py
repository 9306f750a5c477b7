"""Lazy public names for a package whose jax-free half must import without jax.

The package's `__init__.pyi` stub is the one list of what it exports (type checkers and IDEs read it); the
package's `__init__.py` calls `lazy_exports`, which reads the same stub, so the two cannot drift. A name from one
of the `light` modules (no jax) imports that module alone. The first use of any other name imports every other
module of the stub at once, in the stub's order, as an eager `__init__` would: modules that complete one another
on import (named_tensors' indexing attaches itself to NamedArray) are then never seen half-loaded.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any


def _read_stub(stub: Path) -> tuple[dict[str, str], list[str]]:
    """Map each exported name to the module it comes from (relative, e.g. "._core"), and the stub's __all__."""
    tree = ast.parse(stub.read_text(), filename=str(stub))
    where: dict[str, str] = {}
    exported: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                # `from . import nn` names a submodule; `from ._core import Axis` a name inside one.
                where[alias.asname or alias.name] = "." + (node.module or alias.name)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            exported = list(ast.literal_eval(node.value))
    missing = sorted(set(exported) - set(where))
    if missing:
        raise ImportError(f"{stub}: __all__ lists {missing}, which no import of the stub provides")
    return where, exported


def lazy_exports(
    package: str, init_file: str, light: Collection[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """`__getattr__`, `__dir__` and `__all__` for `package`, whose names the `__init__.pyi` beside `init_file`
    lists; `light` names its jax-free modules, relative (e.g. "._axis")."""
    where, exported = _read_stub(Path(init_file).with_suffix(".pyi"))
    heavy = list(dict.fromkeys(module for module in where.values() if module not in light))

    def __getattr__(name: str) -> Any:  # noqa: N807 (the module-level hook of PEP 562)
        module_name = where.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        for needed in [module_name] if module_name in light else heavy:
            importlib.import_module(needed, package)
        module = sys.modules[package + module_name]
        # A submodule is the module itself; anything else is a name inside it.
        value = module if module_name == "." + name else getattr(module, name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:  # noqa: N807
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__, exported
