"""Turn the INPUT arguments (paths, fsspec URLs, globs, `{1..N}` ranges) into an ordered list of shards."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import cast

import fsspec

from shard_cache.errors import BadInputError, ShardCacheError
from shard_cache.fs import get_fs

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_ALTERNATIVES = re.compile(r"\{([^{}]*,[^{}]*)\}")
_GLOB_CHARS = ("*", "?", "[")
HF_PREFIX = "hf:"


@dataclass(frozen=True)
class Shard:
    """One unit of work: the files (usually one) whose documents form one shard, in order."""

    name: str
    files: tuple[str, ...]


def expand_braces(pattern: str) -> list[str]:
    """Expand `{1..N}` ranges (zero padding kept) and `{a,b}` alternatives, leftmost brace first."""
    found = [m for m in (_RANGE.search(pattern), _ALTERNATIVES.search(pattern)) if m is not None]
    if not found:
        return [pattern]
    match = min(found, key=lambda m: m.start())
    head, tail = pattern[: match.start()], pattern[match.end() :]
    if match.re is _RANGE:
        lo_text, hi_text = match.group(1), match.group(2)
        lo, hi = int(lo_text), int(hi_text)
        width = len(lo_text) if lo_text.startswith("0") and len(lo_text) > 1 else 0
        step = 1 if hi >= lo else -1
        choices = [str(i).zfill(width) for i in range(lo, hi + step, step)]
    else:
        choices = match.group(1).split(",")
    return [out for choice in choices for out in expand_braces(f"{head}{choice}{tail}")]


def _protocol_prefix(url: str) -> str:
    return url.split("://", 1)[0] + "://" if "://" in url else ""


def _open_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        return get_fs(url, listings_cache=True)
    except ShardCacheError as exc:
        raise BadInputError(f"input {exc}") from exc


def expand_inputs(inputs: list[str] | tuple[str, ...] | str) -> list[str]:
    """Expand every input into the concrete file URLs it names, in order; fails early on unreachable ones."""
    if isinstance(inputs, str):
        inputs = [inputs]
    files: list[str] = []
    for raw in inputs:
        raw = str(raw)
        if raw.startswith(HF_PREFIX):
            files.append(raw)
            continue
        for pattern in expand_braces(raw):
            fs, path = _open_fs(pattern)
            prefix = _protocol_prefix(pattern)
            if any(ch in path for ch in _GLOB_CHARS):
                try:
                    matches = sorted(cast("list[str]", fs.glob(path)))  # a list without detail=True (fsspec is untyped)
                except Exception as exc:
                    raise BadInputError(f"input {pattern!r}: cannot list it ({exc}). Check the URL.") from exc
                matches = [m for m in matches if not fs.isdir(m)]
                if not matches:
                    raise BadInputError(f"input {pattern!r}: the glob matches no file. Check the pattern.")
                files.extend(prefix + m if prefix and "://" not in m else m for m in matches)
                continue
            try:
                exists = fs.exists(path)
                is_dir = exists and fs.isdir(path)
            except Exception as exc:
                raise BadInputError(
                    f"input {pattern!r}: unreachable ({type(exc).__name__}: {exc}). Check the URL, the "
                    "network and the credentials."
                ) from exc
            if not exists:
                raise BadInputError(f"input {pattern!r}: no such file. Check the path or URL.")
            if is_dir:
                raise BadInputError(
                    f"input {pattern!r} is a directory. Pass its files, for example with a glob "
                    f"'{pattern.rstrip('/')}/*.jsonl'."
                )
            # Ray workers run in other directories: a relative local path must be made absolute here
            files.append(os.path.abspath(pattern) if not prefix else pattern)
    if not files:
        raise BadInputError("no input files were given. Pass at least one path, URL or glob.")
    return files


def group_into_shards(files: list[str], files_per_shard: int = 1) -> list[Shard]:
    """Deal the files into shards of about `files_per_shard` files, round-robin (1: each file is a shard).

    Shard s holds files s, s + S, s + 2S, ... of S shards: neighbouring files (often alike: one folder, one
    source) land in different shards, so each chunk, and the round-robin order over shards, mixes the corpus.
    """
    if files_per_shard < 1:
        raise ValueError(f"files_per_shard must be at least 1, got {files_per_shard}.")
    count = -(-len(files) // files_per_shard)
    shards = []
    for start in range(count):
        group = tuple(files[start::count])
        name = group[0] if len(group) == 1 else f"{group[0]} (+{len(group) - 1} files)"
        shards.append(Shard(name=name, files=group))
    return shards
