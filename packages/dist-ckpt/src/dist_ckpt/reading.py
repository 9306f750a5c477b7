"""Reading regions of saved arrays: whole chunks straight into aligned buffers, the rest in one batch, with progress."""

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


# jax's CPU client adopts host buffers aligned to this many bytes instead of copying them.
_ALIGNMENT = 64


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-ordered array whose data starts on a 64-byte boundary."""
    nbytes = math.prod(shape) * dtype.itemsize
    # numpy allocates large buffers with transparent huge pages, which makes filling them cheaper too
    raw = np.empty(nbytes + _ALIGNMENT, dtype=np.uint8)
    offset = -raw.ctypes.data % _ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def _whole_chunks(key: RegionKey, chunk: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether the region starts and ends on the chunk grid (or the array's end) along every axis."""
    return all(
        start % size == 0 and (stop % size == 0 or stop == extent)
        for (start, stop), size, extent in zip(key, chunk, shape, strict=True)
    )


class _Filled:
    """A pending copy into `out`, awaited like a read future that returns `out`."""

    def __init__(self, write: ts.WriteFutures, out: np.ndarray):
        self.write, self.out = write, out

    def result(self, timeout: float | None = None) -> np.ndarray:
        self.write.result(timeout=timeout)
        return self.out


def read_regions(
    path: Path, entries: list[dict[str, Any]], regions: dict[int, list[RegionKey]], progress: bool
) -> dict[int, dict[RegionKey, np.ndarray]]:
    """Read the listed regions of the arrays (by entry position), each into its own C-ordered array.

    A region made of whole chunks (a resume onto the saved layout) is copied straight into a 64-byte-aligned
    buffer of our own, which jax then adopts without another copy; the other regions (a reshard) are read in
    one tensorstore batch, so that a chunk shared by several regions is read once.
    """
    context = make_context()
    opened = {i: open_for_read(path, entries[i], context) for i in regions}
    batch = ts.Batch()
    futures: list[tuple[int, RegionKey, ts.Future, int]] = []
    for i, store_future in opened.items():
        store = store_future.result()
        itemsize = store.dtype.numpy_dtype.itemsize
        chunk = store.chunk_layout.read_chunk.shape or ()  # None for a 0-d array
        for key in regions[i]:
            index = tuple(slice(start, stop) for start, stop in key)
            nbytes = math.prod(stop - start for start, stop in key) * itemsize
            if key and _whole_chunks(key, chunk, store.shape):
                out = aligned_empty(tuple(stop - start for start, stop in key), store.dtype.numpy_dtype)
                write = ts.array(out, copy=False, write=True).write(store[index].translate_to[0])
                futures.append((i, key, _Filled(write, out), nbytes))
            else:
                futures.append((i, key, store[index].read(batch=batch), nbytes))
    batch.submit()
    line = ProgressLine(
        f"loading {path}", sum(nbytes for *_, nbytes in futures), enabled=progress and jax.process_index() == 0
    )
    arrays = line.wait_all((future, nbytes) for *_, future, nbytes in futures)
    results: dict[int, dict[RegionKey, np.ndarray]] = {i: {} for i in regions}
    for (i, key, *_), array in zip(futures, arrays, strict=True):
        results[i][key] = array
    return results
