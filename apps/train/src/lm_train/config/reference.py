"""A reference of every config key, its type, default and meaning, read from the schema itself."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing
from collections.abc import Iterator
from functools import cache
from typing import Any

from lm_train.config.schema import OptimizerConfig, TrainLmConfig


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The string literal written under each field of a dataclass (and its bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, following in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    text = str(tp).replace("typing.", "")
    if isinstance(tp, type):
        text = tp.__name__
    return text.replace("datetime.timedelta", "duration").replace("NoneType", "None")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def _format_default(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        return ""
    from lm_train.config.loading import _format_duration

    if hasattr(value, "total_seconds"):
        return _format_duration(value)
    if isinstance(value, tuple):
        return (
            "[" + ", ".join(_format_default(v) if dataclasses.is_dataclass(v) is False else str(v) for v in value) + "]"
        )
    return repr(value) if isinstance(value, str) else str(value)


def iter_keys(cls: type, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(dotted key, type, default, doc) for every leaf key under a dataclass."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        default = _default(f)
        if dataclasses.is_dataclass(tp) and not hasattr(tp, "get_known_choices"):
            yield from iter_keys(tp, key + ".")
            continue
        if isinstance(tp, type) and hasattr(tp, "get_known_choices"):
            current = tp.get_choice_name(type(default)) if dataclasses.is_dataclass(default) else None
            choices = sorted(tp.get_known_choices())
            yield key + ".type", "str", repr(current), f"one of: {', '.join(choices)}"
            for name in choices:
                sub = tp.get_choice_class(name)
                yield from iter_keys(sub, f"{key}.<{name}>.")
            continue
        yield key, _type_name(tp), _format_default(default), docs.get(f.name, "")


def config_key_lines() -> list[str]:
    """One line per key, for `lm-train run --help`."""
    lines = []
    for key, tp, default, doc in iter_keys(TrainLmConfig):
        text = f"--{key} ({tp}, default {default})"
        if doc:
            text += f": {doc}"
        lines.append(text)
    return lines


__all__ = ["OptimizerConfig", "config_key_lines", "field_docs", "iter_keys"]
