"""A reference of every config key, its type, default and meaning, read from the schema itself."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import typing
from collections.abc import Iterator
from functools import cache
from typing import TYPE_CHECKING, Any

from lm_train.config.schema import OptimizerConfig, TrainLmConfig

if TYPE_CHECKING:
    from draccus.choice_types import ChoiceType


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The string literal written under each field of a dataclass (and its bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        # Non-dataclass bases count too: LmConfig documents, once, the keys every model family declares.
        if klass is object or not inspect.get_annotations(klass):
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
    return dataclasses.MISSING


def _format_default(value: Any) -> str:
    """The default as the YAML a user writes: `null`, `true`, `f32`, `[mlp, heads]`, `[{every: 10000, ...}]`."""
    import draccus
    import yaml

    from lm_train.config.loading import _format_duration

    if hasattr(value, "total_seconds"):
        return _format_duration(value)
    plain = draccus.encode(value)
    if isinstance(plain, dict) and not plain:
        return "{}"
    text = yaml.safe_dump(plain, default_flow_style=True, width=10**6, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def _optional_section(tp: Any) -> type | None:
    """X for a `X | None` annotation whose X is a plain config dataclass, else None."""
    if typing.get_origin(tp) not in (typing.Union, __import__("types").UnionType):
        return None
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if (
        len(args) == 1
        and isinstance(args[0], type)
        and dataclasses.is_dataclass(args[0])
        and not hasattr(args[0], "get_known_choices")
    ):
        return args[0]
    return None


def iter_keys(cls: type, prefix: str = "", instance: Any = None) -> Iterator[tuple[str, str, str, str]]:
    """(dotted key, type, default, doc) for every leaf key under a dataclass (defaults from `instance` if given)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        default = _default(f) if instance is None else getattr(instance, f.name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and not hasattr(tp, "get_known_choices"):
            # Inside a section, a nested block's defaults are its field's default (gemma3's rope has theta 1e6),
            # not its class's; a top-level section written in a config starts from its class's defaults.
            yield from iter_keys(tp, key + ".", default if prefix and dataclasses.is_dataclass(default) else None)
            continue
        value_type = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
        if isinstance(value_type, type) and dataclasses.is_dataclass(
            value_type
        ):  # {name: section}: the mapping, then each section's keys
            yield key, f"dict[str, {value_type.__name__}]", _format_default(default), docs.get(f.name, "")
            yield from iter_keys(value_type, key + ".<name>.")
            continue
        section = _optional_section(tp)
        if section is not None:  # a section that is off (null) unless given, e.g. `lora`
            yield key, "section | None", _format_default(default), docs.get(f.name, "")
            yield from iter_keys(section, key + ".")
            continue
        if isinstance(tp, type) and hasattr(tp, "get_known_choices"):
            choice = typing.cast("type[ChoiceType]", tp)  # a registry: the hasattr above is what marks one
            current = choice.get_choice_name(type(default)) if dataclasses.is_dataclass(default) else None
            choices = sorted(choice.get_known_choices())
            yield key + ".type", "str", current or "", f"one of: {', '.join(choices)}"
            for name in choices:
                sub = choice.get_choice_class(name)
                yield from iter_keys(sub, f"{key}.<{name}>.")
            continue
        shown = "(required)" if default is dataclasses.MISSING else _format_default(default)
        yield key, _type_name(tp), shown, docs.get(f.name, "")


SECTIONS = ("data", "model", "trainer", "optimizer")
CHOICE_KEY = re.compile(r"^(\w+)\.<([\w-]+)>\.(.+)$")  # model.<gpt2>.seq_len: section, choice, key


def section_of(key: str) -> str:
    """The top-level section a dotted key belongs to; "" for the top-level keys."""
    head = key.split(".", 1)[0]
    return head if "." in key else ""


def _help_line(key: str, tp: str, default: str, doc: str) -> str:
    return f"--{key} ({tp}, default {default or '-'}): {doc}" if doc else f"--{key} ({tp}, default {default or '-'})"


def _merged_choice_lines(rows: list[tuple[str, str, str, str]]) -> list[str]:
    """Keys of a choice section (model.<gpt2>.x, model.<llama>.x, ...) once each, as --model.x, naming the
    choices that have it when not all do; the default when every choice has the same one."""
    choices: list[str] = []
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for key, tp, default, doc in rows:
        match = CHOICE_KEY.match(key)
        if match is None:
            continue
        section, choice, rest = match.groups()
        if choice not in choices:
            choices.append(choice)
        entry = merged.setdefault((f"{section}.{rest}", doc), {"types": [], "defaults": {}})
        if tp not in entry["types"]:
            entry["types"].append(tp)
        entry["defaults"][choice] = default
    lines = []
    for (key, doc), entry in merged.items():
        owners, defaults = list(entry["defaults"]), set(entry["defaults"].values())
        default = defaults.pop() if len(defaults) == 1 else "per type"
        text = _help_line(key, " | ".join(entry["types"]), default, doc)
        if len(owners) < len(choices):
            others = [c for c in choices if c not in owners]
            scope = f"{', '.join(owners)} only" if len(owners) <= len(others) else f"not {', '.join(others)}"
            text = text.replace(")", f"; {scope})", 1)
        lines.append(text)
    return lines


def help_sections() -> list[tuple[str, list[str]]]:
    """(heading, lines) per section of `lm-train run --help`: data, model, trainer, optimizer, others, top level."""
    rows: dict[str, list[tuple[str, str, str, str]]] = {}
    for row in iter_keys(TrainLmConfig):
        rows.setdefault(section_of(row[0]), []).append(row)
    out = []
    for section in (*SECTIONS, *(s for s in rows if s not in SECTIONS and s), ""):
        section_rows = rows.get(section, [])
        plain = [_help_line(*row) for row in section_rows if CHOICE_KEY.match(row[0]) is None]
        merged = _merged_choice_lines(section_rows)
        heading = f"{section}:" if section else "top-level keys:"
        if merged:
            heading = f"{section} (defaults `per type`: docs/configuration.md, or `lm-train config show CONFIG.yaml`):"
        out.append((heading, plain + merged))
    return out


def config_key_lines() -> list[str]:
    """One line per key, section by section, for `lm-train run --help`."""
    return [line for _, lines in help_sections() for line in lines]


__all__ = ["OptimizerConfig", "config_key_lines", "field_docs", "help_sections", "iter_keys", "section_of"]


BEGIN_MARK = "<!-- BEGIN GENERATED KEY REFERENCE: python -m lm_train.config.reference docs/configuration.md -->"
END_MARK = "<!-- END GENERATED KEY REFERENCE -->"


def reference_markdown() -> str:
    """Markdown tables of every key: one per section, and one per model family and optimizer type."""
    tables: dict[str, list[tuple[str, str, str, str]]] = {}
    for key, tp, default, doc in iter_keys(TrainLmConfig):
        match = CHOICE_KEY.match(key)
        section = section_of(key)
        head = f"{section}.type: {match.group(2)}" if match else section or "(top level)"
        tables.setdefault(head, []).append((key, tp, default, doc))
    out = []
    for head, rows in tables.items():
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
