"""Read YAML config files (with !include), merge them, and parse dotted command-line overrides, keeping where each
key came from (file and line, or flag) for error messages."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lm_train.errors import ConfigError

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
    if path.is_dir():
        raise ConfigError(
            f"{path} is a directory, not a config file. Give a YAML file, e.g. configs/gpt2_nano.yaml (to resume a "
            "run, pass the config it was started with; its resolved copy is <run_dir>/config.yaml)."
        )
    if path.resolve() in [p.resolve() for p in stack]:
        chain = " -> ".join(str(p) for p in (*stack, path))
        raise ConfigError(f"Config includes form a cycle: {chain}. Remove one of the !include lines.")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(
            f"Config file {path} cannot be read: {e.strerror}. Give this user read access to it (ls -l {path}; "
            "chmod a+r), or pass a copy that it can read."
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"Config file {path} is not UTF-8 text (byte {e.start} cannot be decoded): it is not a YAML config, or "
            "it is damaged. Give the YAML file, or restore it from a copy."
        ) from None
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


def read_merged(paths: Sequence[str | Path], overrides: Sequence[str] = ()) -> tuple[dict[str, Any], Sources]:
    """Read and merge the files, then apply the overrides: the raw config and where each key came from."""
    raw, sources = read_config_files(paths)
    flags, flag_sources = parse_overrides(overrides)
    sources.update(flag_sources)
    return deep_merge(raw, flags), sources
