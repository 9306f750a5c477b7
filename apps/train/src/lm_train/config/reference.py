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
    if tp is Any:
        return "{name: weight} or stages"  # data.train_weights, checked by the mixture's own parser
    origin = typing.get_origin(tp)
    if origin is tuple:
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"list[{', '.join(_type_name(a) for a in args)}]"
    if origin in (typing.Union, __import__("types").UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if isinstance(tp, type):
        return {
            "timedelta": "duration",
            "NoneType": "None",
            "TrackerList": "tracker or list",
            "ModuleNames": "list[str] | regex",
        }.get(tp.__name__, tp.__name__)
    text = str(tp).replace("typing.", "")
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


def _optional_section(tp: Any) -> type | None:
    """X for a `X | None` annotation whose X is a plain config dataclass, else None."""
    if typing.get_origin(tp) not in (typing.Union, __import__("types").UnionType):
        return None
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and dataclasses.is_dataclass(args[0]) and not hasattr(args[0], "get_known_choices"):
        return args[0]
    return None


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
        value_type = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
        if dataclasses.is_dataclass(value_type):  # {name: section}: the mapping, then each section's keys
            yield key, f"dict[str, {value_type.__name__}]", "{}", docs.get(f.name, "")
            yield from iter_keys(value_type, key + ".<name>.")
            continue
        section = _optional_section(tp)
        if section is not None:  # a section that is off (null) unless given, e.g. `lora`
            yield key, "section | None", _format_default(default), docs.get(f.name, "")
            yield from iter_keys(section, key + ".")
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


BEGIN_MARK = "<!-- BEGIN GENERATED KEY REFERENCE: python -m lm_train.config.reference docs/configuration.md -->"
END_MARK = "<!-- END GENERATED KEY REFERENCE -->"


def reference_markdown() -> str:
    """Markdown tables of every key, one table per top-level section."""
    sections: dict[str, list[tuple[str, str, str, str]]] = {}
    for key, tp, default, doc in iter_keys(TrainLmConfig):
        head = key.split(".", 1)[0] if "." in key else "(top level)"
        sections.setdefault(head, []).append((key, tp, default, doc))
    out = []
    for head, rows in sections.items():
        out.append(f"### `{head}`\n" if head != "(top level)" else "### Top-level keys\n")
        out.append("| key | type | default | meaning |")
        out.append("|---|---|---|---|")
        for key, tp, default, doc in rows:
            cells = [f"`{key}`", tp, f"`{default}`" if default else "", doc]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def update_page(path: str) -> bool:
    """Rewrite the generated part of a markdown page; returns whether it changed."""
    from pathlib import Path

    page = Path(path)
    text = page.read_text(encoding="utf-8")
    start, end = text.index(BEGIN_MARK) + len(BEGIN_MARK), text.index(END_MARK)
    new = text[:start] + "\n\n" + reference_markdown() + "\n" + text[end:]
    if new != text:
        page.write_text(new, encoding="utf-8")
    return new != text


if __name__ == "__main__":
    import sys

    for target in sys.argv[1:]:
        print(f"{target}: {'updated' if update_page(target) else 'up to date'}")
