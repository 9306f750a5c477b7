"""Benchmark of hf_bridge: export and import GB/s of a model sharded over 8 devices, against raw numpy writes
and reads of the same bytes, and the export's peak host memory against its largest tensor.

Prints one JSON line. The reference writes each tensor's bytes with numpy's `tofile` (after gathering it to
the host, as a plain exporter would) and reads them back with `fromfile`, to the same disk, in the same run.
Ours writes sharded safetensors (checked after writing, as every export is) and loads them back onto the same
sharded layout. The page cache is dropped before reads where the machine allows it. GB/s are best-of-N.

Run: `uv run python bench/hf_export.py [--hidden 1024] [--layers 8] [--repeats 3] [--dir PATH]`.
"""

import argparse
import ctypes
import gc
import os
import re
import shutil
import tempfile
from pathlib import Path

from common import best_of, emit, log

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # the CPU as 8 devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

import hf_bridge
import named_tensors as nt
from lm_models import LlamaConfig

MAPPING = {"embed": "data", "mlp": "model", "heads": "model", "kv_heads": "model"}


def sharded_model(config: LlamaConfig, vocab: int, mesh: Mesh):
    rng = np.random.default_rng(0)
    shapes = eqx.filter_eval_shape(lambda: config.build(nt.Axis("vocab", vocab), key=jax.random.key(0)))

    def fill(leaf):
        values = 0.02 * rng.standard_normal(tuple(a.size for a in leaf.axes), dtype=np.float32)
        sharding = NamedSharding(mesh, nt.partition_spec(leaf.axes, MAPPING, mesh))
        return nt.NamedArray(jax.make_array_from_callback(values.shape, sharding, lambda i: values[i]), leaf.axes)

    return jax.tree.map(fill, shapes, is_leaf=nt.is_named)


def drop_page_cache(directory: Path) -> None:
    """Evict the directory's files from the page cache (best effort), so that reads come from the disk."""
    for file in directory.rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def rss_peak(fn) -> int:
    """Peak growth of resident memory while fn() runs (Linux: the VmHWM high-water mark, reset first)."""
    status = Path("/proc/self/status")

    def kib(field: str) -> int:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read_text(), re.MULTILINE).group(1))

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    fn()
    return (kib("VmHWM") - before) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    config = LlamaConfig(
        seq_len=64,
        hidden_dim=args.hidden,
        intermediate_dim=4 * args.hidden,
        num_layers=args.layers,
        num_heads=max(1, args.hidden // 64),
        num_kv_heads=max(1, args.hidden // 128),
    )
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(2, -1) if len(devices) > 1 else np.array(devices).reshape(1, 1),
                ("data", "model"))  # fmt: skip
    model = sharded_model(config, 4096, mesh)
    leaves = jax.tree.leaves(model)
    total = sum(leaf.nbytes for leaf in leaves)
    root = Path(tempfile.mkdtemp(prefix="bench_hf_", dir=args.dir))
    log(f"model: {total / 2**20:.0f} MiB in {len(leaves)} parameters, on {len(devices)} devices; files in {root}")
    try:
        out = root / "ours"
        raw = root / "raw"
        raw.mkdir()

        def export():
            hf_bridge.save_pretrained(model, config, out, max_shard_size="200MB", overwrite=True)

        def raw_write():
            for i, leaf in enumerate(leaves):
                np.asarray(leaf).tofile(raw / f"{i}.bin")  # np.asarray gathers the sharded array to the host

        def raw_read():
            for i, leaf in enumerate(leaves):
                np.fromfile(raw / f"{i}.bin", dtype=leaf.dtype)

        def load():
            drop_page_cache(out)
            loaded = hf_bridge.load_weights(out, model)
            jax.block_until_ready(loaded)

        def raw_load():
            drop_page_cache(raw)
            raw_read()

        export()  # warm: imports and the shards' first host views
        peak = rss_peak(export)
        # The largest checkpoint tensor: one layer of the largest stacked parameter (Llama fuses none).
        named = jax.tree.leaves(model, is_leaf=nt.is_named)
        largest = max(p.array.nbytes // (p.resolve_axis("layers").size if "layers" in p.shape else 1) for p in named)
        save_s = best_of(args.repeats, export)
        raw_save_s = best_of(args.repeats, raw_write)
        load_s = best_of(args.repeats, load)
        raw_load_s = best_of(args.repeats, raw_load)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = total / 1e9
    emit(
        "hf_export",
        {
            "model_mib": round(total / 2**20, 1),
            "save_gbps": round(gb / save_s, 3),
            "load_gbps": round(gb / load_s, 3),
            "save_ratio": round(raw_save_s / save_s, 3),
            "load_ratio": round(raw_load_s / load_s, 3),
            "peak_host_mib": round(peak / 2**20, 1),
            "largest_tensor_mib": round(largest / 2**20, 1),
            "peak_over_largest_tensor": round(peak / largest, 3),
        },
        reference={"raw_save_gbps": round(gb / raw_save_s, 3), "raw_load_gbps": round(gb / raw_load_s, 3)},
        ratio=min(raw_save_s / save_s, raw_load_s / load_s),
        ratio_means="the lower of save_ratio and load_ratio: raw numpy time / hf_bridge time for the same bytes",
    )


if __name__ == "__main__":
    main()
