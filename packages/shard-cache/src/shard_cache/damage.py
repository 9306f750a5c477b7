"""What a damaged chunk is to a reader: the error that names it and its source, and whether it can be rebuilt.

Readers and the repair both use it, so that the read path needs none of the build or repair code.
"""

from __future__ import annotations

from typing import Any

from shard_cache.chunks import parquet_path
from shard_cache.errors import ChunkCorruptError, ShardCacheError
from shard_cache.fs import get_fs
from shard_cache.verify import load_settings


def shard_sources(settings: dict[str, Any], shard: int) -> tuple[str, ...]:
    """The input files of `shard`, as cache.json records them."""
    try:
        return tuple(settings["shards"][shard]["files"])
    except (KeyError, IndexError, TypeError):
        return ()


def sources_present(sources: tuple[str, ...]) -> bool:
    """Whether every input file of a shard is still there (a dataset id counts as present)."""
    if not sources:
        return False
    for url in sources:
        if url.startswith("hf:"):
            continue  # a dataset id: reading it is the only check
        try:
            fs, path = get_fs(url, listings_cache=True)
            if not fs.exists(path):
                return False
        except Exception:
            return False
    return True


def damaged_chunk_error(url: str, fs: Any, root: str, shard: int, chunk: int, why: str) -> ChunkCorruptError:
    """The error for a damaged chunk: names the chunk and its source, and gives the fix that applies."""
    path = parquet_path(root, shard, chunk)
    try:
        sources = shard_sources(load_settings(fs, root, url), shard)
    except ShardCacheError:
        sources = ()
    present = sources_present(sources)
    source_text = ", ".join(sources) if sources else "unknown (cache.json is unreadable)"
    if present:
        fix = (
            f"Its source is still there: `shard-cache verify {url} --repair --tokenizer TOKENIZER` rebuilds it with "
            "the same bytes (or open the cache with repair_with=...)."
        )
    else:
        fix = "Its source is gone, so it cannot be rebuilt: restore the source, or rebuild the cache from the inputs."
    return ChunkCorruptError(
        f"{path}: committed chunk {chunk} of shard {shard} is damaged ({why}); source: {source_text}. {fix}",
        path=path,
        shard=shard,
        chunk=chunk,
        sources=sources,
        source_present=present,
    )
