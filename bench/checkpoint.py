"""Benchmark of dist_ckpt: save/load GB/s against raw writes/reads of the same bytes, on local disk and in an
S3 bucket, what the checksums cost, and async blocking.

Prints three JSON lines:
- `checkpoint`: local disk. The reference (numpy `tofile` + fsync per array, `fromfile` to read) runs in the
  same process, on the same disk, with the same bytes; both sides' files are evicted from the page cache
  before each read, so reads come from the disk. Loads are timed onto the saved layout (a resume) and onto
  another layout (a reshard).
- `checkpoint.checksums`: the same save and load (local disk) with checksums (crc32c per chunk, digests in the
  manifest, checked on load) against without them (`checksums=False`).
- `checkpoint.s3`: save and load to moto's S3 server, started in this script on localhost, against boto3
  put_object / get_object of the same bytes (one object per chunk, 16 threads), in the same run.
GB/s figures are best-of-N and ratios the median of back-to-back pairs, to damp the noise of other work on
the machine.

Run: `uv run python bench/checkpoint.py [--mib 256] [--s3-mib 64] [--repeats 5] [--dir PATH]`.
"""

import argparse
import logging
import os
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import emit, log

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # the CPU as 8 devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
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


def ckpt_save(state: dict, directory: Path | str, checksums: bool = True) -> tuple[float, float]:
    """(seconds the caller was blocked in save(), seconds until the checkpoint was committed)."""
    start = time.perf_counter()
    dist_ckpt.save(state, directory, step=0, progress=False, checksums=checksums)
    blocked = time.perf_counter() - start
    dist_ckpt.wait()
    return blocked, time.perf_counter() - start


def ckpt_load(target: dict, directory: Path | str) -> float:
    if isinstance(directory, Path):
        evict_from_page_cache(directory)
    start = time.perf_counter()
    loaded = dist_ckpt.load(directory, target, progress=False)
    jax.block_until_ready(loaded)
    return time.perf_counter() - start


def paired_ratio(times: dict[str, list[float]], reference: str, ours: str) -> float:
    """Median over repeats of reference time / our time: each pair ran back to back, under the same load."""
    return float(np.median([r / o for r, o in zip(times[reference], times[ours], strict=True)]))


def start_s3_server() -> str:
    """moto's S3 server on a free localhost port, reached through the standard AWS variables; its endpoint."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False).start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1"
    )
    return endpoint


def shard_bytes(state: dict) -> list[tuple[str, bytes]]:
    """One (key, bytes) per saved chunk, as dist_ckpt stores them: the boto3 reference puts the same objects."""
    pieces = []
    for name, array in state.items():
        for i, shard in enumerate(array.addressable_shards):
            pieces.append((f"raw/{name}/{i}", np.asarray(shard.data).tobytes()))
    return pieces


def bench_s3(state: dict, same: dict, repeats: int) -> dict:
    """Save/load GB/s of dist_ckpt to the S3 server against boto3 puts/gets of the same chunks."""
    import boto3

    endpoint = start_s3_server()
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    pieces = shard_bytes(state)
    nbytes = sum(len(data) for _, data in pieces)
    pool = ThreadPoolExecutor(16)

    def put_all() -> float:
        start = time.perf_counter()
        list(pool.map(lambda kv: client.put_object(Bucket="bench", Key=kv[0], Body=kv[1]), pieces))
        return time.perf_counter() - start

    def get_all() -> float:
        start = time.perf_counter()
        sizes = pool.map(lambda kv: len(client.get_object(Bucket="bench", Key=kv[0])["Body"].read()), pieces)
        assert sum(sizes) == nbytes
        return time.perf_counter() - start

    def empty_bucket() -> None:
        keys = [item["Key"] for item in client.list_objects_v2(Bucket="bench").get("Contents", [])]
        while keys:
            client.delete_objects(Bucket="bench", Delete={"Objects": [{"Key": k} for k in keys[:1000]]})
            keys = [item["Key"] for item in client.list_objects_v2(Bucket="bench").get("Contents", [])]

    times: dict[str, list[float]] = {k: [] for k in ("put", "get", "save", "load")}
    for repeat in range(repeats):
        url = f"s3://bench/ckpt/step-{repeat}"
        times["put"].append(put_all())
        times["save"].append(ckpt_save(state, url)[1])
        times["get"].append(get_all())
        times["load"].append(ckpt_load(same, url))
        empty_bucket()  # moto keeps objects in memory
    gbps = {name: nbytes / min(values) / 1e9 for name, values in times.items()}
    save_ratio, load_ratio = paired_ratio(times, "put", "save"), paired_ratio(times, "get", "load")
    return {
        "bytes": nbytes,
        "objects": len(pieces),
        "save_gbps": round(gbps["save"], 3),
        "boto3_put_gbps": round(gbps["put"], 3),
        "save_ratio": round(save_ratio, 3),
        "load_gbps": round(gbps["load"], 3),
        "boto3_get_gbps": round(gbps["get"], 3),
        "load_ratio": round(load_ratio, 3),
        "repeats": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="total size of the saved arrays, MiB")
    parser.add_argument("--s3-mib", type=int, default=64, help="size for the S3 part (at most --mib), MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the system disk)")
    args = parser.parse_args()

    state, host, same, reshard = make_state(args.mib)
    nbytes = sum(value.nbytes for value in host.values())
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir))
    kinds = ("raw_write", "raw_read", "save", "load", "reshard", "blocked", "save_unchecked", "load_unchecked")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for repeat in range(args.repeats):
            raw_dir, ckpt_dir, plain_dir = work / f"raw-{repeat}", work / f"step-{repeat}", work / f"plain-{repeat}"
            times["raw_write"].append(raw_write(host, raw_dir))
            # With and without checksums alternate which goes first, so that neither always meets the other's
            # writeback or a warmer machine.
            checked_first = repeat % 2 == 0
            for checksums in (checked_first, not checked_first):
                blocked, total = ckpt_save(state, ckpt_dir if checksums else plain_dir, checksums=checksums)
                if checksums:
                    times["blocked"].append(blocked)
                times["save" if checksums else "save_unchecked"].append(total)
            times["raw_read"].append(raw_read(host, raw_dir))
            for checksums in (checked_first, not checked_first):
                load_time = ckpt_load(same, ckpt_dir if checksums else plain_dir)
                times["load" if checksums else "load_unchecked"].append(load_time)
            times["reshard"].append(ckpt_load(reshard, ckpt_dir))
            for directory in (raw_dir, ckpt_dir, plain_dir):
                shutil.rmtree(directory)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    best = {name: min(values) for name, values in times.items()}
    gbps = {name: nbytes / best[name] / 1e9 for name in kinds if name != "blocked"}

    # The blocked fraction pairs each run's blocked time with that same run's total.
    blocked_fraction = float(np.median([b / t for b, t in zip(times["blocked"], times["save"], strict=True)]))
    save_ratio, load_ratio = paired_ratio(times, "raw_write", "save"), paired_ratio(times, "raw_read", "load")
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
            "reshard_load_ratio": round(paired_ratio(times, "raw_read", "reshard"), 3),
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
    checked_save = paired_ratio(times, "save_unchecked", "save")
    checked_load = paired_ratio(times, "load_unchecked", "load")
    emit(
        "checkpoint.checksums",
        {
            "bytes": nbytes,
            "save_gbps": round(gbps["save"], 3),
            "save_unchecked_gbps": round(gbps["save_unchecked"], 3),
            "save_ratio": round(checked_save, 3),
            "load_gbps": round(gbps["load"], 3),
            "load_unchecked_gbps": round(gbps["load_unchecked"], 3),
            "load_ratio": round(checked_load, 3),
            "repeats": args.repeats,
        },
        reference={
            "save_unchecked_gbps": round(gbps["save_unchecked"], 3),
            "load_unchecked_gbps": round(gbps["load_unchecked"], 3),
        },
        ratio=min(checked_save, checked_load),
        ratio_means="the lower of save_ratio and load_ratio: GB/s with checksums (written, and checked on load) / "
        "GB/s of the same save or load with checksums=False, median of back-to-back pairs; aim >= 0.9",
    )

    log(f"checkpoint.s3: {min(args.s3_mib, args.mib)} MiB to a local moto S3 server")
    s3_state, _, s3_same, _ = make_state(min(args.s3_mib, args.mib))
    s3 = bench_s3(s3_state, s3_same, args.repeats)
    emit(
        "checkpoint.s3",
        s3,
        reference={"boto3_put_gbps": s3["boto3_put_gbps"], "boto3_get_gbps": s3["boto3_get_gbps"]},
        ratio=min(s3["save_ratio"], s3["load_ratio"]),
        ratio_means="the lower of save_ratio and load_ratio: dist-ckpt GB/s to moto's S3 server / boto3 put_object "
        "and get_object of the same chunks (16 threads) to the same server, median of back-to-back pairs; "
        "aim >= 0.7",
    )


if __name__ == "__main__":
    main()
