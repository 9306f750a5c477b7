"""The ledger a build starts from: the one on disk, or one rebuilt from the chunk files when it is missing or
damaged (each chunk's metadata JSON is its commit marker), so that nothing intact is tokenized again."""

from __future__ import annotations

import json
import logging

import fsspec

from shard_cache.chunks import CHUNKS_DIR, crc32c, metadata_path, parquet_path, sha256
from shard_cache.errors import CacheCorruptError
from shard_cache.fs import join, list_names, read_bytes
from shard_cache.inputs import Shard
from shard_cache.ledger import LEDGER_NAME, ChunkEntry, Ledger, ShardState

log = logging.getLogger("shard_cache")


def _intact_chunk(fs: fsspec.AbstractFileSystem, root: str, shard: int, chunk: int) -> tuple[ChunkEntry, dict] | None:
    """The entry of a chunk whose Parquet file matches its metadata JSON, or None."""
    try:
        meta = json.loads(read_bytes(fs, metadata_path(root, shard, chunk)))
        data = read_bytes(fs, parquet_path(root, shard, chunk))
        if not isinstance(meta, dict) or meta.get("sha256") != sha256(data) or meta.get("bytes") != len(data):
            return None
        entry = ChunkEntry(docs=int(meta["docs"]), tokens={k: int(v) for k, v in meta["tokens"].items()})
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return None
    entry.crc32c = crc32c(data)
    return entry, meta


def recover_ledger(fs: fsspec.AbstractFileSystem, root: str, shards: list[Shard]) -> Ledger:
    """A ledger of the consecutive intact chunks of each shard, every shard still to finish.

    The build then reads each shard through again, tokenizing only the chunks after the recovered ones, and
    writes the same ledger an uninterrupted build would have.
    """
    states = []
    for s, shard in enumerate(shards):
        names = set(list_names(fs, join(root, CHUNKS_DIR, f"{s:05d}")))
        state = ShardState(name=shard.name)
        while f"{len(state.chunks):06d}.json" in names:
            found = _intact_chunk(fs, root, s, len(state.chunks))
            if found is None:
                break
            state.chunks.append(found[0])
            state.skipped = {k: int(v) for k, v in found[1].get("skipped_so_far", {}).items()}
        states.append(state)
    ledger = Ledger(shards=states)
    ledger.refresh_order()
    return ledger


def _lists_shards(ledger: Ledger, shards: list[Shard]) -> bool:
    return [s.name for s in ledger.shards] == [s.name for s in shards]


def finished_ledger(fs: fsspec.AbstractFileSystem, root: str, url: str, shards: list[Shard]) -> Ledger | None:
    """The ledger on disk when it says the build of these shards finished, else None (missing, damaged, unfinished).

    It only reads: a finished ledger is never written again, so a build that finds one needs no lock.
    """
    try:
        ledger = Ledger.from_json(read_bytes(fs, join(root, LEDGER_NAME)), where=f"{url}/{LEDGER_NAME}")
    except (FileNotFoundError, CacheCorruptError):
        return None
    if not (ledger.finished and _lists_shards(ledger, shards)):
        return None
    _fill_checksums(fs, root, ledger)  # in memory: a ledger of 0.2 lacks them
    return ledger


def load_build_ledger(fs: fsspec.AbstractFileSystem, root: str, url: str, shards: list[Shard]) -> tuple[Ledger, str]:
    """The ledger to build from, and a note for the user when it had to be rebuilt (else "")."""
    where = f"{url}/{LEDGER_NAME}"
    try:
        ledger = Ledger.from_json(read_bytes(fs, join(root, LEDGER_NAME)), where=where)
    except FileNotFoundError:
        if not list_names(fs, join(root, CHUNKS_DIR)):
            return Ledger(shards=[ShardState(name=s.name) for s in shards]), ""  # a new cache
        problem = "is missing"
    except CacheCorruptError as exc:
        problem = f"is damaged ({exc.__cause__ or exc})"
    else:
        if _lists_shards(ledger, shards):
            _fill_checksums(fs, root, ledger)
            return ledger, ""
        problem = "does not list the shards of cache.json"
    ledger = recover_ledger(fs, root, shards)
    chunks = sum(len(s.chunks) for s in ledger.shards)
    return ledger, (
        f"{where} {problem}: rebuilt it from the chunk files ({chunks} intact chunks kept); the build reads every "
        "input again and tokenizes only what is missing."
    )


def _fill_checksums(fs: fsspec.AbstractFileSystem, root: str, ledger: Ledger) -> None:
    """Give chunks of a ledger written before 0.3 their CRC-32C, from data that matches its metadata sha256."""
    for s, state in enumerate(ledger.shards):
        for c, entry in enumerate(state.chunks):
            if entry.crc32c is None:
                found = _intact_chunk(fs, root, s, c)
                if found is None:
                    raise CacheCorruptError(
                        f"{parquet_path(root, s, c)}: committed chunk is missing or does not match its metadata "
                        f"JSON. Run `shard-cache verify {root} --repair --tokenizer TOKENIZER` to rebuild it."
                    )
                entry.crc32c = found[0].crc32c
