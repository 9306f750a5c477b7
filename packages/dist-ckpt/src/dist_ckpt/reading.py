"""Reading regions of saved arrays: one tensorstore read per distinct region, batched, with progress."""

import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from dist_ckpt.progress import ProgressLine
from dist_ckpt.storage import make_context, open_for_read

Index = tuple[slice, ...]
RegionKey = tuple[tuple[int, int], ...]


def region_key(index: Index, shape: tuple[int, ...]) -> RegionKey:
    """A hashable (start, stop) per axis for an index that may hold open slices."""
    return tuple(part.indices(size)[:2] for part, size in zip(index, shape, strict=True))


def regions_needed(shape: tuple[int, ...], sharding: Any) -> list[RegionKey]:
    """The distinct regions this process's devices hold under `sharding` (the whole array without one)."""
    if sharding is None:
        return [tuple((0, size) for size in shape)]
    keys = {region_key(index, shape) for index in sharding.addressable_devices_indices_map(shape).values()}
    return sorted(keys)


def read_regions(
    path: Path, entries: list[dict[str, Any]], regions: dict[int, list[RegionKey]], progress: bool
) -> dict[int, dict[RegionKey, np.ndarray]]:
    """Read the listed regions of the arrays (by entry position), all in one tensorstore batch.

    Each region lands in its own C-ordered array; the batch lets tensorstore read a chunk shared by several
    regions once, which a reshard onto a finer or shifted layout needs.
    """
    context = make_context()
    opened = {i: open_for_read(path, entries[i], context) for i in regions}
    batch = ts.Batch()
    futures: list[tuple[int, RegionKey, ts.Future, int]] = []
    for i, store_future in opened.items():
        store = store_future.result()
        itemsize = store.dtype.numpy_dtype.itemsize
        for key in regions[i]:
            index = tuple(slice(start, stop) for start, stop in key)
            nbytes = math.prod(stop - start for start, stop in key) * itemsize
            futures.append((i, key, store[index].read(batch=batch), nbytes))
    batch.submit()
    line = ProgressLine(
        f"loading {path}", sum(nbytes for *_, nbytes in futures), enabled=progress and jax.process_index() == 0
    )
    results: dict[int, dict[RegionKey, np.ndarray]] = {i: {} for i in regions}
    done_bytes = 0
    for i, key, future, nbytes in futures:
        while True:
            try:
                results[i][key] = future.result(timeout=1.0)
                break
            except TimeoutError:
                line.update(done_bytes)
        done_bytes += nbytes
        line.update(done_bytes)
    line.finish()
    return results
