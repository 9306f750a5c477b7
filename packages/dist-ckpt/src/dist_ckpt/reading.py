"""Reading regions of saved arrays: whole chunks straight into aligned buffers, the rest in one batch, with progress."""

import concurrent.futures
import math
from typing import Any, cast

import jax
import numpy as np
import tensorstore as ts

from dist_ckpt.direct_read import read_directly, readable_directly
from dist_ckpt.integrity import (
    array_error,
    cells_overlapping,
    check_trailers,
    chunk_grid,
    read_trailers,
    region_crcs,
    unpack_crcs,
)
from dist_ckpt.layout import ARRAYS_DIR, OCDBT_DIR, corrupt
from dist_ckpt.location import Location
from dist_ckpt.progress import ProgressLine
from dist_ckpt.storage import chunk_key, make_context, open_for_read

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
    """A pending copy into `out`, awaited like a read future that returns `out`; `check(out)` runs as soon as it
    is filled, on the thread that completed the copy, and its error (if any) is raised by result()."""

    def __init__(self, write: ts.WriteFutures, out: np.ndarray, check: Any = None):
        self.write, self.out = write, out
        self.checked: concurrent.futures.Future | None = None
        if check is not None:
            # The check (a crc32c, which releases the GIL) overlaps the reads still in flight, instead of
            # running on the caller's thread only once it comes to wait for this array.
            checked: concurrent.futures.Future = concurrent.futures.Future()
            self.checked = checked

            def run(done: Any) -> None:
                if done.exception() is not None:
                    checked.set_result(None)  # result() raises the copy's own error
                    return
                try:
                    check(out)
                    checked.set_result(None)
                except BaseException as error:  # handed to result(), on the caller's thread
                    checked.set_exception(error)

            write.add_done_callback(run)

    def result(self, timeout: float | None = None) -> np.ndarray:
        self.write.result(timeout=timeout)
        if self.checked is not None:
            self.checked.result(timeout=timeout)
        return self.out


def array_url(path: Location, entry: dict[str, Any]) -> str:
    """Where a saved array's files are, for messages."""
    if entry.get("ocdbt", False):
        return f"{path.url_of(OCDBT_DIR)} (array {entry['array']})"
    return path.url_of(f"{ARRAYS_DIR}/{entry['array']}")


class _Checked:
    """A read future whose failure is reported as a damaged or unreadable file of the checkpoint."""

    def __init__(self, future: Any, path: Location, entry: dict[str, Any]):
        self.future, self.path, self.entry = future, path, entry

    def result(self, timeout: float | None = None) -> np.ndarray:
        try:
            return self.future.result(timeout=timeout)
        except ValueError as error:
            raise array_error(error, self.path, self.entry, array_url(self.path, self.entry)) from None


def open_checked(path: Location, entry: dict[str, Any], store_future: ts.Future) -> ts.TensorStore:
    """The opened array, after checking that its stored metadata describes the array of the manifest."""
    url = array_url(path, entry)
    try:
        store = store_future.result()
    except ValueError as error:
        raise array_error(error, path, entry, f"{url}/zarr.json") from None
    stored = (list(store.shape), store.dtype.name, list(store.chunk_layout.read_chunk.shape or ()))
    saved = (list(entry["shape"]), ts.dtype(entry["dtype"]).name, list(entry["chunk_shape"]))
    if stored != saved:
        raise corrupt(
            path,
            f"{url}/zarr.json",
            f"describes an array of shape, dtype and chunks {stored}, but the manifest saved {saved}",
            key=entry["path"],
        )
    return store


def _digest_check(path: Location, entry: dict[str, Any], key: RegionKey) -> Any:
    """A check that the chunks of a whole-chunk region, as read, are those whose crc32c the manifest records."""

    def check(out: np.ndarray) -> None:
        shape, chunk = tuple(entry["shape"]), tuple(entry["chunk_shape"])
        expected = unpack_crcs(entry)
        grid = chunk_grid(shape, chunk)
        for flat, crc in region_crcs(out, key, chunk, shape).items():
            if crc != int(expected[flat]):
                cell = np.unravel_index(flat, grid) if grid else ()
                raise corrupt(
                    path,
                    f"{array_url(path, entry)}/{chunk_key(tuple(int(i) for i in cell))}",
                    f"holds a chunk whose data (crc32c {crc:#010x}) is not the one the manifest records "
                    f"({int(expected[flat]):#010x}): the file was replaced by another chunk, or altered along with "
                    "its checksum",
                    key=entry["path"],
                )

    return check


def read_regions(
    path: Location, entries: list[dict[str, Any]], regions: dict[int, list[RegionKey]], progress: bool
) -> dict[int, dict[RegionKey, np.ndarray]]:
    """Read the listed regions of the arrays (by entry position), each into its own C-ordered array.

    A region made of whole chunks (a resume onto the saved layout) is copied straight into a 64-byte-aligned
    buffer of our own, which jax then adopts without another copy; the other regions (a reshard) are read in
    one tensorstore batch, so that a chunk shared by several regions is read once.

    Checksums (tensorstore checks each chunk's bytes against the crc32c stored with it): the chunks of a
    whole-chunk region are then checked against the manifest's digest from the data in memory, which costs
    no request; for the other regions, the checksum stored at the end of each chunk is read and compared.
    On local disk, a whole-chunk region of a checksummed array is read with plain file reads instead, with the
    same two checks (dist_ckpt.direct_read).
    """
    context = make_context()
    opened = {i: open_for_read(path, entries[i], context) for i in regions}
    batch = ts.Batch()
    futures: list[tuple[int, RegionKey, Any, int]] = []
    trailers = []
    for i, store_future in opened.items():
        entry = entries[i]
        store = open_checked(path, entry, store_future)
        itemsize = store.dtype.numpy_dtype.itemsize
        # None for a 0-d array; zarr's read chunks are whole numbers in every dimension.
        chunk = cast(tuple[int, ...], store.chunk_layout.read_chunk.shape or ())
        checked = "chunk_crc32c" in entry
        partial: set[tuple[int, ...]] = set()
        for key in regions[i]:
            index = tuple(slice(start, stop) for start, stop in key)
            nbytes = math.prod(stop - start for start, stop in key) * itemsize
            if key and _whole_chunks(key, chunk, store.shape):
                out = aligned_empty(tuple(stop - start for start, stop in key), store.dtype.numpy_dtype)
                if readable_directly(path, entry, store, key, tuple(chunk)):
                    direct = read_directly(path, entry, key, tuple(chunk), out, array_url(path, entry))
                    futures.append((i, key, direct, nbytes))
                    continue
                write = ts.array(out, copy=False, write=True).write(store[index].translate_to[0])
                check = _digest_check(path, entry, key) if checked else None
                futures.append((i, key, _Checked(_Filled(write, out, check), path, entry), nbytes))
            else:
                futures.append((i, key, _Checked(store[index].read(batch=batch), path, entry), nbytes))
                if checked:
                    partial.update(cells_overlapping(key, tuple(chunk)))
        if partial:
            trailers.append((entry, read_trailers(store, entry, sorted(partial), batch)))
    batch.submit()
    for entry, pending in trailers:
        check_trailers(path, entry, pending, array_url(path, entry))
    line = ProgressLine(
        f"loading {path}", sum(nbytes for *_, nbytes in futures), enabled=progress and jax.process_index() == 0
    )
    arrays = line.wait_all((future, nbytes) for *_, future, nbytes in futures)
    results: dict[int, dict[RegionKey, np.ndarray]] = {i: {} for i in regions}
    for (i, key, *_), array in zip(futures, arrays, strict=True):
        results[i][key] = array
    return results
