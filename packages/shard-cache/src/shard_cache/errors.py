"""Exceptions that shard-cache raises for bad input and misuse; each message names the file and the fix."""

from __future__ import annotations

import storage_io


class ShardCacheError(Exception):
    """Base of every error shard-cache raises on purpose."""


class BadInputError(ShardCacheError):
    """An input document or file that cannot be used (malformed, missing field, unreadable)."""


class CacheLockedError(ShardCacheError):
    """Another live builder holds the cache directory's lock."""


class CacheMismatchError(ShardCacheError):
    """An existing cache was built with different settings than the ones asked for now."""


class CacheCorruptError(ShardCacheError):
    """A cache file is missing, unreadable, or fails its checksum."""


class ChunkCorruptError(CacheCorruptError):
    """One committed chunk is missing, unreadable or fails its checksum.

    `path` is the chunk's Parquet file, `shard`/`chunk` its place in the ledger, `sources` the input files it was
    made from, and `source_present` whether those are all still there (then `repair_cache` can rebuild it).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str = "",
        shard: int = -1,
        chunk: int = -1,
        sources: tuple[str, ...] = (),
        source_present: bool = False,
    ):
        super().__init__(message)
        self.path = path
        self.shard = shard
        self.chunk = chunk
        self.sources = sources
        self.source_present = source_present

    def __reduce__(self):  # keeps the fields across Ray and pickling
        return (
            _rebuild_chunk_error,
            (str(self), self.path, self.shard, self.chunk, self.sources, self.source_present),
        )


def _rebuild_chunk_error(message, path, shard, chunk, sources, present) -> ChunkCorruptError:
    return ChunkCorruptError(message, path=path, shard=shard, chunk=chunk, sources=sources, source_present=present)


class StorageError(ShardCacheError, storage_io.StorageError):
    """A file or object could not be read or written: permission, a full disk, an unreachable store.

    `location` names it and `reason` is the kind of failure (storage_io.REASONS)."""


class TokenizerFileError(ShardCacheError):
    """A tokenizer file is missing, unreadable or damaged; `path` names it."""

    def __init__(self, message: str, *, path: str = ""):
        super().__init__(message)
        self.path = path

    def __reduce__(self):
        return (_rebuild_tokenizer_error, (str(self), self.path))


def _rebuild_tokenizer_error(message, path) -> TokenizerFileError:
    return TokenizerFileError(message, path=path)
