"""Benchmark of dist_ckpt: save/load GB/s against raw numpy writes/reads of the same bytes, and async blocking.

Prints one JSON line. The reference (numpy `tofile` + fsync per array, `fromfile` to read) runs in the same
process, on the same disk, with the same bytes; both sides' files are evicted from the page cache before each
read, so reads come from the disk. Loads are timed onto the saved layout (a resume) and onto another layout (a
reshard). GB/s figures are best-of-N and ratios the median of back-to-back pairs, to damp the noise of
other work on the machine.

Run: `uv run python bench/checkpoint.py [--mib 256] [--repeats 5] [--dir PATH]`.
"""

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from common import emit

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dist_ckpt

ARRAYS = 8


def make_state(total_mib: int) -> tuple[dict, dict[str, np.ndarray], dict, dict]:
    """A state of ARRAYS float32 arrays sharded over all devices, its host copy, and two load targets:
    the saved layout (a resume) and another layout (a reshard)."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    rows = total_mib * 2**20 // (ARRAYS * 4 * 1024)
    rng = np.random.default_rng(0)
    host = {f"w{i}": rng.standard_normal((rows, 1024), dtype=np.float32) for i in range(ARRAYS)}
    sharding = NamedSharding(mesh, P("data", "model"))
    state = {name: jax.device_put(value, sharding) for name, value in host.items()}
    other = NamedSharding(mesh, P("model", "data"))
    same = {name: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for name, v in host.items()}
    reshard = {name: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other) for name, v in host.items()}
    return state, host, same, reshard


def evict_from_page_cache(directory: Path) -> None:
    """Drop the (clean, fsynced) pages of every file under `directory`, so that reads come from the disk."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_write(host: dict[str, np.ndarray], directory: Path) -> float:
    directory.mkdir(parents=True)
    start = time.perf_counter()
    for name, value in host.items():
        with open(directory / f"{name}.bin", "wb") as file:
            value.tofile(file)
            file.flush()
            os.fsync(file.fileno())
    return time.perf_counter() - start


def raw_read(host: dict[str, np.ndarray], directory: Path) -> float:
    evict_from_page_cache(directory)
    start = time.perf_counter()
    for name, value in host.items():
        read = np.fromfile(directory / f"{name}.bin", dtype=value.dtype).reshape(value.shape)
        assert read.shape == value.shape
    return time.perf_counter() - start


def ckpt_save(state: dict, directory: Path) -> tuple[float, float]:
    """(seconds the caller was blocked in save(), seconds until the checkpoint was committed)."""
    start = time.perf_counter()
    dist_ckpt.save(state, directory, step=0, progress=False)
    blocked = time.perf_counter() - start
    dist_ckpt.wait()
    return blocked, time.perf_counter() - start


def ckpt_load(target: dict, directory: Path) -> float:
    evict_from_page_cache(directory)
    start = time.perf_counter()
    loaded = dist_ckpt.load(directory, target, progress=False)
    jax.block_until_ready(loaded)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="total size of the saved arrays, MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the system disk)")
    args = parser.parse_args()

    state, host, same, reshard = make_state(args.mib)
    nbytes = sum(value.nbytes for value in host.values())
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir))
    times: dict[str, list[float]] = {k: [] for k in ("raw_write", "raw_read", "save", "load", "reshard", "blocked")}
    try:
        for repeat in range(args.repeats):
            raw_dir, ckpt_dir = work / f"raw-{repeat}", work / f"step-{repeat}"
            times["raw_write"].append(raw_write(host, raw_dir))
            blocked, total = ckpt_save(state, ckpt_dir)
            times["blocked"].append(blocked)
            times["save"].append(total)
            times["raw_read"].append(raw_read(host, raw_dir))
            times["load"].append(ckpt_load(same, ckpt_dir))
            times["reshard"].append(ckpt_load(reshard, ckpt_dir))
            shutil.rmtree(raw_dir)
            shutil.rmtree(ckpt_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    best = {name: min(values) for name, values in times.items()}
    gbps = {name: nbytes / best[name] / 1e9 for name in ("raw_write", "raw_read", "save", "load", "reshard")}

    def paired_ratio(reference: str, ours: str) -> float:
        """Median over repeats of reference time / our time: each pair ran back to back, under the same load."""
        return float(np.median([r / o for r, o in zip(times[reference], times[ours], strict=True)]))

    # The blocked fraction pairs each run's blocked time with that same run's total.
    blocked_fraction = float(np.median([b / t for b, t in zip(times["blocked"], times["save"], strict=True)]))
    save_ratio, load_ratio = paired_ratio("raw_write", "save"), paired_ratio("raw_read", "load")
    emit(
        "checkpoint",
        {
            "bytes": nbytes,
            "arrays": ARRAYS,
            "devices": jax.device_count(),
            "save_gbps": round(gbps["save"], 3),
            "raw_write_gbps": round(gbps["raw_write"], 3),
            "save_ratio": round(save_ratio, 3),
            "load_gbps": round(gbps["load"], 3),
            "raw_read_gbps": round(gbps["raw_read"], 3),
            "load_ratio": round(load_ratio, 3),
            "reshard_load_gbps": round(gbps["reshard"], 3),
            "reshard_load_ratio": round(paired_ratio("raw_read", "reshard"), 3),
            "async_blocked_s": round(best["blocked"], 4),
            "async_total_s": round(best["save"], 4),
            "async_blocked_fraction": round(blocked_fraction, 3),
            "repeats": args.repeats,
        },
        reference={"raw_write_gbps": round(gbps["raw_write"], 3), "raw_read_gbps": round(gbps["raw_read"], 3)},
        ratio=min(save_ratio, load_ratio),
        ratio_means="the lower of save_ratio and load_ratio: dist-ckpt GB/s / raw numpy GB/s of the same bytes, "
        "median of back-to-back pairs; aim >= 0.7",
    )


if __name__ == "__main__":
    main()
