"""Worker: one process of a jax.distributed job that saves a sharded reference tree.

argv: process_id num_processes port out_dir [ocdbt] [URL...]: saves OUT_DIR/step-7 and URL/step-7 for each
bucket URL given (s3://... or gs://...).
"""

import sys

import jax
import numpy as np
from dist_ckpt_testdata import reference_arrays
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dist_ckpt

process_id, num_processes, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
ocdbt = "ocdbt" in sys.argv[5:]
bucket_roots = [arg for arg in sys.argv[5:] if "://" in arg]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
ref = reference_arrays()
specs = {
    "embed": P("data", "model"),  # split over both processes and devices
    "mlp": P(None, "model"),  # replicated across processes: one copy must be written
    "bias": P("model"),
    "mu": P("data"),
    "key": P(),  # fully replicated
    "mask": P("model", None),
}


def global_array(name: str) -> jax.Array:
    value = ref[name]
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, specs[name]), lambda i: value[i])


tree = {
    "params": {name: global_array(name) for name in ("embed", "mlp", "bias")},
    "opt_state": ({"mu": global_array("mu")}, None),
    "key": global_array("key"),
    "mask": global_array("mask"),
    "host_counts": np.arange(6, dtype=np.int64),
    "step": 7,
}
for root in [out, *bucket_roots]:
    dist_ckpt.save(tree, f"{root}/step-7", step=7, metadata={"run": "mp"}, ocdbt=ocdbt)
    dist_ckpt.wait()
print(f"process {process_id} saved", flush=True)
jax.distributed.shutdown()
