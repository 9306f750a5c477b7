"""Loading streams tensor by tensor (never two full copies in host memory), optionally sharded by axis name."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
from jax.sharding import Mesh

import hf_bridge
from lm_models import Gpt2Config


def _model_bytes(model) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(model))


# Run in a fresh interpreter: tracemalloc counts every thread's allocations, and in a long test session other
# tests' background threads (object-store servers, writers) would be counted as ours.
_MEASURE = """
import json, sys, tracemalloc
import hf_bridge
src, out, shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
model, config = hf_bridge.load_pretrained(src)
# A first round outside the trace, so that one-off allocations (compiled slicing, imports) do not count.
hf_bridge.save_pretrained(model, config, out + "/warm", max_shard_size=shard)
hf_bridge.load_pretrained(out + "/warm")
tracemalloc.start()
hf_bridge.save_pretrained(model, config, out + "/ckpt", max_shard_size=shard)
save_peak = tracemalloc.get_traced_memory()[1]
tracemalloc.reset_peak()
start = tracemalloc.get_traced_memory()[0]
loaded = hf_bridge.load_pretrained(out + "/ckpt")
kept, load_peak = tracemalloc.get_traced_memory()
tracemalloc.stop()
print(json.dumps({"save_peak": save_peak, "load_peak": load_peak - start, "kept_by_model": kept - start}))
"""


def test_sharded_load_and_save_hold_less_than_one_model_copy_in_host_memory(make_model, tmp_path):
    config = Gpt2Config(seq_len=16, hidden_dim=64, num_layers=6, num_heads=4)
    model = make_model(config, 500)
    size = _model_bytes(model)
    hf_bridge.save_pretrained(model, config, tmp_path / "source")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "source"), str(tmp_path), str(size // 8)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    # numpy's host buffers are traced. On CPU a device array may keep the host buffer it was made from (jax
    # aliases a suitably aligned numpy array instead of copying it), so part of the loaded model itself is
    # traced: `kept_by_model`, which varies from run to run with the buffers' alignment. Beyond it, saving holds
    # about one shard (an eighth) at a time, loading about one stacked parameter (the largest is 30% of this
    # model): well under the one or two whole copies that reading everything first would need.
    assert peaks["save_peak"] < 0.4 * size, (peaks, size)
    assert peaks["load_peak"] - peaks["kept_by_model"] < 0.6 * size, (peaks, size)
    loaded, _ = hf_bridge.load_pretrained(tmp_path / "ckpt")
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_places_each_parameter_sharded_by_axis_name(tiny_gpt2, tmp_path):
    model, config = tiny_gpt2
    hf_bridge.save_pretrained(model, config, tmp_path / "ckpt")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    mapping = {"embed": "data", "mlp": "model"}
    loaded, _ = hf_bridge.load_pretrained(tmp_path / "ckpt", mesh=mesh, axis_mapping=mapping)
    up = loaded.blocks.stacked.mlp.up.weight  # (layers, mlp, embed)
    assert up.array.sharding.spec == jax.sharding.PartitionSpec(None, "model", "data")
    assert len(up.array.addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(up.array), np.asarray(model.blocks.stacked.mlp.up.weight.array))


def test_load_weights_into_a_sharded_model_keeps_its_shardings(tiny_gpt2, tmp_path):
    model, config = tiny_gpt2
    hf_bridge.save_pretrained(model, config, tmp_path / "ckpt")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    mapping = {"embed": "data", "mlp": "model"}
    import named_tensors as nt

    zeros = jax.tree.map(lambda x: nt.NamedArray(x.array * 0, x.axes), model, is_leaf=nt.is_named)
    target = nt.shard_tree(zeros, mapping, mesh)
    loaded = hf_bridge.load_weights(tmp_path / "ckpt", target)
    for a, b, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(target), jax.tree.leaves(model), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(want))


def test_mixtral_experts_load_and_save_sharded_over_the_experts_axis(make_model, tmp_path):
    # Mixtral keeps one checkpoint tensor per (layer, expert): with `experts` sharded over 4 devices and `embed`
    # over 2, each device's shard is filled from the tensors of its own experts only, and the sharded model
    # exports byte for byte what the unsharded one does.
    from safetensors.numpy import load_file

    from lm_models import MixtralConfig

    config = MixtralConfig(
        seq_len=8, hidden_dim=16, intermediate_dim=12, num_layers=2, num_heads=2, num_kv_heads=1, n_routed_experts=4
    )
    model = make_model(config, 40)
    hf_bridge.save_pretrained(model, config, tmp_path / "ckpt")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("model", "data"))
    mapping = {"experts": "model", "embed": "data"}
    loaded, _ = hf_bridge.load_pretrained(tmp_path / "ckpt", mesh=mesh, axis_mapping=mapping)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    experts = [leaf for leaf in jax.tree.leaves(loaded, is_leaf=lambda x: hasattr(x, "axes")) if hasattr(leaf, "axes")]
    sharded = [leaf for leaf in experts if "experts" in [a.name for a in leaf.axes] and leaf.array.ndim == 4]
    assert sharded and all("model" in leaf.array.sharding.spec for leaf in sharded)
    hf_bridge.save_pretrained(loaded, config, tmp_path / "again")
    first, again = (
        load_file(tmp_path / "ckpt" / "model.safetensors"),
        load_file(tmp_path / "again" / "model.safetensors"),
    )
    assert sorted(first) == sorted(again) and "model.layers.1.block_sparse_moe.experts.3.w2.weight" in first
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
