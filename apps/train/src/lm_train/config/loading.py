"""Read YAML configs (with !include), merge them, apply dotted overrides, and decode into dataclasses."""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import draccus
import yaml
from draccus.choice_types import ChoiceType
from draccus.utils import DecodingError, ParsingError

from lm_train.errors import ConfigError

T = TypeVar("T")
KeyPath = tuple[str, ...]


@dataclass
class Sources:
    """Where each key of a merged config came from: a file and line, or a command-line flag."""

    locations: dict[KeyPath, str] = field(default_factory=dict)

    def where(self, path: Sequence[str]) -> str:
        """The most specific known location of a key path (falls back to its parents)."""
        path = tuple(path)
        while path:
            if path in self.locations:
                return self.locations[path]
            path = path[:-1]
        return self.locations.get((), "the config")

    def update(self, other: Sources) -> None:
        self.locations.update(other.locations)


class _IncludeLoader(yaml.SafeLoader):
    """SafeLoader that keeps node positions so that errors can name a line."""


def _read_yaml_file(path: Path, stack: tuple[Path, ...] = ()) -> tuple[Any, Sources]:
    if not path.exists():
        hint = ""
        if stack:
            hint = f" (included from {stack[-1]})"
        raise ConfigError(
            f"Config file {path} does not exist{hint}. Check the path; relative includes are resolved "
            "against the directory of the file that includes them."
        )
    if path.resolve() in [p.resolve() for p in stack]:
        chain = " -> ".join(str(p) for p in (*stack, path))
        raise ConfigError(f"Config includes form a cycle: {chain}. Remove one of the !include lines.")
    text = path.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text, Loader=_IncludeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(
            f"{where}: this is not valid YAML ({problem}). Fix the syntax at that line (mind indentation, "
            "and quote values that contain ': ' or start with special characters)."
        ) from None
    sources = Sources()
    sources.locations[()] = str(path)
    if node is None:
        return {}, sources
    value = _construct(node, path, (), sources, (*stack, path))
    return value, sources


def _construct(node: yaml.Node, path: Path, key_path: KeyPath, sources: Sources, stack: tuple[Path, ...]) -> Any:
    sources.locations[key_path] = f"{path}:{node.start_mark.line + 1}"
    if node.tag == "!include":
        if not isinstance(node, yaml.ScalarNode):
            raise ConfigError(f"{path}:{node.start_mark.line + 1}: !include takes a file path, e.g. `!include x.yaml`")
        included_path = (path.parent / node.value).expanduser()
        value, inner = _read_yaml_file(included_path, stack)
        for k, loc in inner.locations.items():
            sources.locations[key_path + k] = loc
        return value
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            if key == "<<":  # YAML merge key: fold the referenced mapping in, explicit keys win
                merged = _construct(value_node, path, key_path, sources, stack)
                for k, v in (merged or {}).items():
                    out.setdefault(k, v)
                continue
            if key in out:
                raise ConfigError(
                    f"{path}:{key_node.start_mark.line + 1}: key {'.'.join((*key_path, key))!r} appears "
                    "twice. Keep one of them."
                )
            out[key] = _construct(value_node, path, (*key_path, str(key)), sources, stack)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(v, path, (*key_path, str(i)), sources, stack) for i, v in enumerate(node.value)]
    loader = _IncludeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def read_config_files(paths: Sequence[str | Path]) -> tuple[dict[str, Any], Sources]:
    """Read and deep-merge YAML files in order (later files win), following !include."""
    merged: dict[str, Any] = {}
    sources = Sources()
    for p in paths:
        value, src = _read_yaml_file(Path(p))
        if not isinstance(value, dict):
            raise ConfigError(f"{p}: the top level of a config must be a mapping of sections (data:, model:, ...).")
        merged = deep_merge(merged, value)
        sources.update(src)
    return merged, sources


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Merge override into base recursively; a `type` change replaces the whole mapping."""
    out = dict(base)
    for k, v in override.items():
        old = out.get(k)
        if isinstance(old, Mapping) and isinstance(v, Mapping):
            if "type" in v and "type" in old and v["type"] != old["type"]:
                out[k] = dict(v)
            else:
                out[k] = deep_merge(old, v)
        else:
            out[k] = v
    return out


_FLAG = re.compile(r"^--([A-Za-z_][\w\-]*(?:\.[\w\-]+)*)(?:=(.*))?$", re.DOTALL)


def parse_overrides(args: Sequence[str]) -> tuple[dict[str, Any], Sources]:
    """Turn `--a.b value` / `--a.b=value` pairs into a nested dict; values are read as YAML."""
    out: dict[str, Any] = {}
    sources = Sources()
    i = 0
    args = list(args)
    while i < len(args):
        m = _FLAG.match(args[i])
        if not m:
            raise ConfigError(
                f"Cannot read command-line argument {args[i]!r}: overrides look like "
                "`--trainer.num_train_steps 500` or `--trainer.num_train_steps=500`."
            )
        key, raw = m.group(1), m.group(2)
        if raw is None:
            if i + 1 >= len(args) or _FLAG.match(args[i + 1]):
                raise ConfigError(f"Override --{key} has no value: give one, e.g. `--{key} 10`.")
            raw = args[i + 1]
            i += 1
        i += 1
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        parts = tuple(p.replace("-", "_") for p in key.split("."))
        node = out
        for p in parts[:-1]:
            existing = node.get(p)
            if not isinstance(existing, dict):
                existing = node[p] = {}
            node = existing
        node[parts[-1]] = value
        sources.locations[parts] = f"command-line flag --{key}"
    return out, sources


# -- decoding -----------------------------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(raw: Any) -> timedelta:
    """`90` (seconds), `"10m"`, `"1h30m"`, `"2d"` -> timedelta."""
    if isinstance(raw, timedelta):
        return raw
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return timedelta(seconds=raw)
    if isinstance(raw, str):
        text = raw.strip().replace(" ", "")
        pos, total = 0, 0.0
        for m in _DURATION.finditer(text):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
            pos = m.end()
        if text and pos == len(text):
            return timedelta(seconds=total)
        try:
            return timedelta(seconds=float(text))
        except ValueError:
            pass
    raise ValueError(f"cannot read {raw!r} as a duration; write e.g. 90, '30s', '10m', '1h30m' or '2d'")


draccus.decode.register(timedelta, lambda raw, path=(): parse_duration(raw))
draccus.encode.register(timedelta, lambda td: _format_duration(td))


def _format_duration(td: timedelta) -> str:
    seconds = td.total_seconds()
    for unit in ("d", "h", "m"):
        size = _UNIT_SECONDS[unit]
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _is_choice_type(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, ChoiceType)


def _unwrap_optional(tp: Any) -> list[Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _check_keys(tp: Any, raw: Any, path: KeyPath, sources: Sources) -> None:
    """Walk raw config against the dataclass schema; unknown keys and types get a suggestion."""
    for candidate in _unwrap_optional(tp):
        origin = typing.get_origin(candidate)
        if origin in (list, tuple, Sequence) and isinstance(raw, list):
            args = typing.get_args(candidate)
            if args:
                for i, item in enumerate(raw):
                    _check_keys(args[0], item, (*path, str(i)), sources)
            return
        if _is_choice_type(candidate) and isinstance(raw, dict):
            choices = candidate.get_known_choices()
            name = raw.get("type", candidate.default_choice_name())
            if name is None:
                raise ConfigError(
                    f"{sources.where(path)}: `{_dotted(path)}` needs a `type:` key, one of {sorted(choices)}."
                )
            if name not in choices:
                raise ConfigError(
                    f"{sources.where((*path, 'type'))}: unknown {_dotted(path)}.type {name!r}. "
                    f"Known types: {', '.join(sorted(choices))}.{_suggest(str(name), choices)}"
                )
            cls = choices[name]
            _check_dataclass_keys(cls, {k: v for k, v in raw.items() if k != "type"}, path, sources)
            return
        if dataclasses.is_dataclass(candidate) and isinstance(raw, dict):
            _check_dataclass_keys(candidate, raw, path, sources)
            return


def _check_dataclass_keys(cls: type, raw: dict, path: KeyPath, sources: Sources) -> None:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(
                f"{sources.where((*path, key))}: unknown key `{_dotted((*path, key))}`."
                f"{_suggest(key, names, prefix=_dotted(path))} "
                f"Valid keys of `{_dotted(path) or 'the top level'}`: {', '.join(names)}."
            )
        _check_keys(hints[key], value, (*path, key), sources)


def _suggest(word: str, options: Sequence[str] | Mapping[str, Any], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if not close:
        return ""
    full = f"{prefix}.{close[0]}" if prefix else close[0]
    return f" Did you mean `{full}`?"


def _dotted(path: Sequence[str]) -> str:
    return ".".join(path)


def decode_config(cls: type[T], raw: dict[str, Any], sources: Sources) -> T:
    """Validate keys, then decode into the typed (frozen) dataclass, reporting errors by file and line."""
    _check_keys(cls, raw, (), sources)
    try:
        return draccus.decode(cls, raw)
    except DecodingError as e:
        path = tuple(e.key_path)
        raise ConfigError(
            f"{sources.where(path)}: bad value for `{_dotted(path)}`: {_clean(e.message)}. "
            "Fix the value in the config or the override."
        ) from None
    except ParsingError as e:
        cause = e.__cause__
        detail = str(cause) if cause is not None else str(e)
        raise ConfigError(f"{sources.where(())}: invalid config: {detail}") from None


def _clean(message: str) -> str:
    message = re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], message)
    return message.replace("\n\t", " ").rstrip(".")


def load_config(cls: type[T], paths: Sequence[str | Path], overrides: Sequence[str] = ()) -> tuple[T, dict[str, Any]]:
    """Read files, merge them, apply overrides, decode; returns the config and the merged raw dict."""
    raw, sources = read_config_files(paths)
    flags, flag_sources = parse_overrides(overrides)
    raw = deep_merge(raw, flags)
    sources.update(flag_sources)
    return decode_config(cls, raw, sources), raw


def dump_config(config: Any) -> str:
    """The resolved config as YAML, with every default filled in."""
    return draccus.dump(config)
