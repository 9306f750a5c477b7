"""hf-bridge across 2 processes x 4 CPU devices (jax.distributed, gloo): a model sharded over both hosts is
exported to an s3:// bucket (each tensor fetched shard by shard, process 0 writing), and loaded back sharded,
each process reading from the bucket only the rows its own devices hold."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess]

# The model is made the same way in every process and in the test, from the seed: each leaf's values are
# rng(leaf index), so any process can check any shard.
MODEL = """
import equinox as eqx
import jax
import numpy as np
import named_tensors as nt
from lm_models import LlamaConfig

CONFIG = LlamaConfig(seq_len=16, hidden_dim=64, intermediate_dim=256, num_layers=3, num_heads=8, num_kv_heads=4)
VOCAB = 128
# Rows of most checkpoint tensors (vocab, heads, mlp for up/gate) are split over the two hosts' "data" axis.
MAPPING = {"vocab": "data", "heads": "data", "kv_heads": "data", "mlp": "data", "embed": "model"}


def reference_values():
    shapes = eqx.filter_eval_shape(lambda: CONFIG.build(nt.Axis("vocab", VOCAB), key=jax.random.key(0)))
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=nt.is_named)
    values = [np.random.default_rng(i).standard_normal(tuple(a.size for a in l.axes), dtype=np.float32)
              for i, l in enumerate(leaves)]
    return leaves, treedef, values
"""

SCRIPT = """
import json, logging, os, sys
import jax

jax.distributed.initialize(
    coordinator_address=os.environ["LM_TRAIN_COORDINATOR_ADDRESS"],
    num_processes=int(os.environ["LM_TRAIN_NUM_PROCESSES"]),
    process_id=int(os.environ["LM_TRAIN_PROCESS_ID"]),
)
import numpy as np
from jax.sharding import Mesh, NamedSharding
import hf_bridge
import named_tensors as nt
from model_def import CONFIG, MAPPING, reference_values

url = sys.argv[1]
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))  # data rows 0-1 on process 0, 2-3 on 1
leaves, treedef, values = reference_values()

def place(leaf, value):
    sharding = NamedSharding(mesh, nt.partition_spec(leaf.axes, MAPPING, mesh))
    return nt.NamedArray(jax.make_array_from_callback(value.shape, sharding, lambda i: value[i]), leaf.axes)

model = jax.tree.unflatten(treedef, [place(l, v) for l, v in zip(leaves, values)])
assert not model.blocks.stacked.mlp.up.weight.array.is_fully_addressable
hf_bridge.save_pretrained(model, CONFIG, url, max_shard_size="200KB")

messages = []
handler = logging.Handler()
handler.emit = lambda record: messages.append(record.getMessage())
logging.getLogger("hf_bridge").addHandler(handler)
logging.getLogger("hf_bridge").setLevel(logging.INFO)
loaded, config = hf_bridge.load_pretrained(url, mesh=mesh, axis_mapping=MAPPING)
assert config == CONFIG
checked = 0
for leaf, value, got in zip(leaves, values, jax.tree.leaves(loaded, is_leaf=nt.is_named)):
    assert got.array.sharding == NamedSharding(mesh, nt.partition_spec(leaf.axes, MAPPING, mesh))
    for shard in got.array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
        checked += 1
read, total = (int(w) for w in messages[-1].split() if w.isdigit())

# A failure on the writer half-way (here: its storage fails on the third tensor) reaches every process, which
# all raise it instead of waiting for each other in the next collective.
import hf_bridge.writer

real_write, calls = hf_bridge.writer._write, []

def failing_write(*args):
    calls.append(1)
    if len(calls) == 3:
        raise hf_bridge.HfBridgeError("the test's storage failed")
    return real_write(*args)

if jax.process_index() == 0:
    hf_bridge.writer._write = failing_write
try:
    hf_bridge.save_pretrained(model, CONFIG, url + "-failed", max_shard_size="200KB")
    failure = None
except hf_bridge.HfBridgeError as e:
    failure = str(e)
with open(os.environ["MP_RESULT_FILE"], "w") as f:
    json.dump({"read": read, "total": total, "checked": checked, "failure": failure}, f)
"""


def s3fs_exists(url: str) -> bool:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return fs.exists(path)


def test_two_processes_export_to_and_load_from_a_bucket(tmp_path, launch, s3_server):
    (tmp_path / "model_def.py").write_text(textwrap.dedent(MODEL), encoding="utf-8")
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT), encoding="utf-8")
    url = s3_server.url(s3_server.new_bucket(), "export")
    env = {"PYTHONPATH": str(tmp_path)}
    results = launch([sys.executable, str(script), url], 2, cwd=tmp_path, log_dir=tmp_path / "logs", env=env)
    for r in results:
        assert r.result["checked"] > 0
        # Each process read well under all of the checkpoint: mostly its own rows, plus the few tensors whose
        # rows are split within a host only (o_proj, down_proj and the norms).
        assert r.result["read"] < 0.75 * r.result["total"], r.result
    assert sum(r.result["read"] for r in results) >= results[0].result["total"]
    assert results[0].result["failure"] == "the test's storage failed"
    assert results[1].result["failure"] == "the test's storage failed (reported by process 0, which writes the export)"
    assert not s3fs_exists(url + "-failed/config.json")

    # What process 0 wrote, read back here by one process, is the model.
    import jax

    import hf_bridge
    import named_tensors as nt

    sys.path.insert(0, str(tmp_path))
    try:
        from model_def import reference_values
    finally:
        sys.path.remove(str(tmp_path))
    _, _, values = reference_values()
    loaded, _ = hf_bridge.load_pretrained(url)
    for value, got in zip(values, jax.tree.leaves(loaded, is_leaf=nt.is_named), strict=True):
        np.testing.assert_array_equal(np.asarray(got.array), value)
