"""Decode merged raw config into the typed dataclasses: every key checked against the schema first, so that an
unknown key or a bad value is reported by file and line, with a suggestion."""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import draccus
from draccus.choice_types import ChoiceType
from draccus.utils import DecodingError, ParsingError

from lm_train.config.batch_sizes import bad_value_text
from lm_train.config.levanter_keys import key_hint, value_hint
from lm_train.config.levanter_translation import translate_levanter_keys
from lm_train.config.trainer_config import TrackerList
from lm_train.config.yaml_files import KeyPath, Sources, read_merged
from lm_train.errors import ConfigError

T = TypeVar("T")

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
        if origin in (dict, Mapping) and isinstance(raw, dict):  # {name: section}, e.g. a mixture's data.configs
            args = typing.get_args(candidate)
            if len(args) == 2:
                for name, item in raw.items():
                    _check_keys(args[1], item, (*path, str(name)), sources)
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
            _check_dataclass_keys(cls, raw, path, sources, skip="type")  # in place: fixes made below are kept
            return
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate) and isinstance(raw, dict):
            _check_dataclass_keys(candidate, raw, path, sources)
            return


def _check_dataclass_keys(cls: type, raw: dict, path: KeyPath, sources: Sources, skip: str | None = None) -> None:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key, value in list(raw.items()):
        if key == skip:
            continue
        hint = key_hint((*path, key)) if key not in names else value_hint((*path, key), value)
        if hint is not None:
            raise ConfigError(
                f"{sources.where((*path, key))}: `{_dotted((*path, key))}: {value!r}` is Levanter's, and lm-train "
                f"does not take it: {hint}"
            )
        if key not in names:
            raise ConfigError(
                f"{sources.where((*path, key))}: unknown key `{_dotted((*path, key))}`."
                f"{_suggest(key, names, prefix=_dotted(path))} "
                f"Valid keys of `{_dotted(path) or 'the top level'}`: {', '.join(names)}."
            )
        value = _sequence_if_listed(hints[key], value, (*path, key), sources)
        value = raw[key] = _choice_if_named(hints[key], value, (*path, key), sources)
        if path:  # a top-level section written in a config starts from its class's defaults (data: {train_urls})
            value = raw[key] = _with_field_defaults(cls, key, hints[key], value)
        _check_keys(hints[key], value, (*path, key), sources)


def _with_field_defaults(cls: type, name: str, tp: Any, value: Any) -> Any:
    """A partly written nested block starts from its field's default, not its class's: `model: {type: gemma3,
    rope: {factor: 2.0}}` keeps gemma3's rope theta of 1e6 (RopeConfig's own is 1e4)."""
    if not (isinstance(value, dict) and isinstance(tp, type) and dataclasses.is_dataclass(tp)) or _is_choice_type(tp):
        return value
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default_factory is dataclasses.MISSING:
        return value
    default = field.default_factory()
    try:
        plain = tp()
    except (TypeError, ConfigError):  # required fields, or checks that a bare instance fails: not comparable
        plain = None
    if not dataclasses.is_dataclass(default) or default == plain:
        return value
    return {**draccus.encode(default), **value}


def _choice_if_named(tp: Any, value: Any, path: KeyPath, sources: Sources) -> Any:
    """`format: chat` for a choice section is short for `format: {type: chat}`."""
    options = _unwrap_optional(tp)
    if len(options) != 1 or not _is_choice_type(options[0]) or not isinstance(value, str):
        return value
    known = sorted(options[0].get_known_choices())
    if value not in known:
        raise ConfigError(
            f"{sources.where(path)}: `{_dotted(path)}` is one of {', '.join(known)} (or a mapping with a `type:` "
            f"key, e.g. `{{type: {known[0]}}}`); got {value!r}.{_suggest(value, known)}"
        )
    return {"type": value}


def _is_sequence_type(tp: Any) -> bool:
    return all(typing.get_origin(c) in (list, tuple, Sequence) for c in _unwrap_optional(tp))


def _sequence_if_listed(tp: Any, value: Any, path: KeyPath, sources: Sources) -> Any:
    """A single value given for a list key is a one-element list (never split into characters).

    A string in brackets that YAML could not read as a list (`[data/train_{0..3}.jsonl]`: YAML takes `{` for a
    mapping) is split at its top-level commas.
    """
    if not _is_sequence_type(tp) or isinstance(value, list | dict) or value is None:
        return value
    if not isinstance(value, str):
        return [value]
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        items = [item.strip().strip("'\"") for item in _top_level_items(text[1:-1])]
        return [item for item in items if item]
    if text.startswith("[") or text.endswith("]"):
        key = _dotted(path)
        raise ConfigError(
            f"{sources.where(path)}: `{key}` is a list, and {value!r} is not one. Give one value "
            f"(`--{key} data/train.jsonl`) or a list (`--{key} '[data/a.jsonl, data/b.jsonl]'`; in YAML "
            f"`{path[-1]}: [data/a.jsonl, data/b.jsonl]`)."
        )
    return [value]


def _top_level_items(text: str) -> list[str]:
    """Split at commas that are outside braces, brackets and quotes (brace patterns keep their commas)."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


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
    translate_levanter_keys(raw, sources)
    _check_keys(cls, raw, (), sources)
    try:
        return draccus.decode(cls, raw)
    except DecodingError as e:
        path = tuple(e.key_path)
        own = _config_error_in(e)
        if own is not None:  # a section's own check (__post_init__) already says what is wrong and what to do
            raise ConfigError(f"{sources.where(path)}: {own}") from None
        if path[:2] == ("trainer", "train_batch_size"):  # an int or a schedule: draccus's message names both types
            raise ConfigError(f"{sources.where(path)}: {bad_value_text(raw['trainer']['train_batch_size'])}") from None
        raise ConfigError(
            f"{sources.where(path)}: bad value for `{_dotted(path)}`: {_clean(e.message)}. "
            "Fix the value in the config or the override."
        ) from None
    except ParsingError as e:
        cause = e.__cause__
        detail = str(cause) if cause is not None else str(e)
        raise ConfigError(f"{sources.where(())}: invalid config: {detail}") from None


def _config_error_in(error: BaseException) -> ConfigError | None:
    """The ConfigError that draccus wrapped (raised by a config dataclass's own checks), if any."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, ConfigError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _clean(message: str) -> str:
    message = re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], message)
    return message.replace("\n\t", " ").rstrip(".")


def load_config(cls: type[T], paths: Sequence[str | Path], overrides: Sequence[str] = ()) -> tuple[T, dict[str, Any]]:
    """Read files, merge them, apply overrides, decode; returns the config and the merged raw dict."""
    raw, sources = read_merged(paths, overrides)
    return decode_config(cls, raw, sources), raw


def dump_config(config: Any) -> str:
    """The resolved config as YAML, with every default filled in."""
    return typing.cast(str, draccus.dump(config))  # the text: draccus returns None only when given a stream


def _decode_trackers(raw: Any, path: Sequence[str] = ()) -> TrackerList:
    import trackers

    # Levanter's tracker key defaults to wandb: `tracker: {project: p, tags: [...]}` has no `type`.
    if isinstance(raw, Mapping) and "type" not in raw:
        raw = {"type": "wandb", **raw}
    elif isinstance(raw, list):
        raw = [{"type": "wandb", **item} if isinstance(item, Mapping) and "type" not in item else item for item in raw]
    try:
        return TrackerList(trackers.tracker_configs_from_value(raw, ".".join(path) or "trainer.tracker"))
    except trackers.TrackerConfigError as e:  # draccus adds the key path; decode_config adds file and line
        raise ValueError(str(e)) from None


draccus.decode.register(TrackerList, _decode_trackers)
draccus.encode.register(TrackerList, lambda value: [config.to_dict() for config in value])
