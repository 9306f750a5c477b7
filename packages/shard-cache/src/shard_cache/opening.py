"""Open a cache to read, waiting for its first chunk; with `repair_with`, a reader that rebuilds damaged chunks.

The one place where the read path meets the repair: readers themselves take only a repair function.
"""

from __future__ import annotations

import time

from shard_cache.build_failures import build_failure
from shard_cache.errors import ShardCacheError
from shard_cache.ledger import LEDGER_NAME
from shard_cache.reader import CacheReader
from shard_cache.repair import chunk_repairer


def open_cache(
    cache_dir: str,
    *,
    timeout: float | None = 0.0,
    poll_interval: float = 0.2,
    verify_checksums: bool = True,
    repair_with: object = None,
) -> CacheReader:
    """Open a cache for reading; waits up to `timeout` seconds for its ledger to appear.

    Chunks are checked against their checksums when first read (`verify_checksums`); `repair_with` (the cache's
    tokenizer, a path to it, or its processor) rebuilds a damaged chunk from its source instead of failing.
    """
    repairer = None if repair_with is None else chunk_repairer(cache_dir, repair_with)
    reader = CacheReader(cache_dir, poll_interval=poll_interval, verify_checksums=verify_checksums, repairer=repairer)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        reader.refresh(force=True)
        if reader._ledger is not None:
            return reader
        failed = build_failure(cache_dir)
        if failed is not None:
            raise ShardCacheError(
                f"{cache_dir}: waiting for its first chunk, but its build in this process failed before it "
                f"committed one: {failed}"
            ) from None
        if deadline is not None and time.monotonic() >= deadline:
            raise ShardCacheError(
                f"{cache_dir}: no {LEDGER_NAME} there, so it is not a shard-cache cache, or its build has not "
                "committed a chunk yet, or its ledger was deleted. Check the path, or pass a timeout to wait for "
                "the build; if the ledger was deleted, run the build command again to rebuild it from the chunks."
            )
        time.sleep(poll_interval)
