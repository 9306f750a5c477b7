"""A model sharded over 8 devices is exported one tensor at a time: sharded safetensors that the safetensors
library and transformers read, written with a host-memory peak below twice the largest tensor, whatever the
model's size (measured two ways, on a model 20x its largest tensor, against a full gather measured alike)."""

import ctypes
import gc
import json
import re
import tracemalloc
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from safetensors.numpy import load_file

import hf_bridge
import named_tensors as nt
from lm_models import LlamaConfig

# 6 layers of 28 MB (the three 8 MB MLP matrices are the largest tensors) and 2 x 2 MB of embeddings.
CONFIG = LlamaConfig(seq_len=16, hidden_dim=512, intermediate_dim=4096, num_layers=6, num_heads=8, num_kv_heads=4)
VOCAB = 1024
MAPPING = {"embed": "data", "mlp": "model", "heads": "model", "kv_heads": "model"}


def _rss_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE).group(1))


def rss_peak(fn) -> int:
    """The peak growth of this process's resident memory while fn() runs, in bytes (every allocator counts)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap goes back, so that reusing it would not hide a peak
    before = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark VmHWM to the current RSS
    fn()
    return (_rss_kib("VmHWM") - before) * 1024


def traced_peak(fn) -> int:
    """The peak of memory allocated through Python's allocators (numpy's buffers included) while fn() runs."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def sharded_random_model(config, vocab_size: int, mesh: Mesh, mapping: dict, seed: int = 0):
    """A model of ours with random weights, each parameter made on the host and placed sharded by axis name."""
    rng = np.random.default_rng(seed)
    shapes = eqx.filter_eval_shape(lambda: config.build(nt.Axis("vocab", vocab_size), key=jax.random.key(0)))

    def fill(leaf):
        values = 0.2 * rng.standard_normal(tuple(a.size for a in leaf.axes), dtype=np.float32)
        sharding = NamedSharding(mesh, nt.partition_spec(leaf.axes, mapping, mesh))
        return nt.NamedArray(jax.make_array_from_callback(values.shape, sharding, lambda i: values[i]), leaf.axes)

    return jax.tree.map(fill, shapes, is_leaf=nt.is_named)


@pytest.fixture(scope="module")
def sharded_export(tmp_path_factory):
    """The model on a 4 x 2 mesh, its export, and the measured peaks of the export and of a full gather."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("measuring peak RSS needs Linux's /proc/self/clear_refs")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    model = sharded_random_model(CONFIG, VOCAB, mesh, MAPPING)
    leaves = jax.tree.leaves(model)
    assert all(len(leaf.sharding.device_set) == 8 for leaf in leaves)
    root = tmp_path_factory.mktemp("sharded")
    # Once unmeasured, so that one-off costs (imports, the shards' first host views) do not count.
    hf_bridge.save_pretrained(model, CONFIG, root / "warm", max_shard_size="40MB")
    out = root / "export"

    def export():
        hf_bridge.save_pretrained(model, CONFIG, out, max_shard_size="40MB", overwrite=True)

    peaks = {
        "rss": rss_peak(export),
        "traced": traced_peak(export),
        "gather_rss": rss_peak(lambda: [np.array(leaf) for leaf in leaves]),
        "gather_traced": traced_peak(lambda: [np.array(leaf) for leaf in leaves]),
    }
    return model, out, peaks


def test_export_peak_host_memory_is_below_twice_the_largest_tensor(sharded_export):
    model, out, peaks = sharded_export
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 4 and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in files)
    tensors = {}
    for f in files:
        tensors.update(load_file(str(out / f)))  # the reference reader
    largest = max(t.nbytes for t in tensors.values())
    total = sum(t.nbytes for t in tensors.values())
    assert index["metadata"]["total_size"] == total and total > 20 * largest
    # The measures see a full gather (so they would see one in the export)...
    assert peaks["gather_rss"] > 0.9 * total and peaks["gather_traced"] > 0.9 * total, peaks
    # ...and the export holds less than two of its largest tensors at its peak.
    assert peaks["rss"] < 2 * largest, (peaks, largest)
    assert peaks["traced"] < 2 * largest, (peaks, largest)
    up = model.blocks.stacked.mlp.up.weight  # (layers, mlp, embed): HF's (out, in) layout per layer
    np.testing.assert_array_equal(tensors["model.layers.4.mlp.up_proj.weight"], np.asarray(up.array[4]))
    q = model.blocks.stacked.self_attn.q_proj.weight  # (layers, heads, head_size, embed)
    np.testing.assert_array_equal(
        tensors["model.layers.2.self_attn.q_proj.weight"], np.asarray(q.array[2]).reshape(512, 512)
    )


def test_transformers_loads_the_sharded_export_with_the_same_logits(hf, parity, ids_for, sharded_export):
    model, out, _ = sharded_export
    ids = ids_for(VOCAB, 16)
    theirs = hf.transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    parity.assert_close(parity.hf_logits(hf, theirs, ids), parity.our_logits(model, ids))
