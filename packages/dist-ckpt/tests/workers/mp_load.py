"""Worker: one process of a jax.distributed job that loads a reference checkpoint onto the global mesh and
checks every shard it holds against the reference values (bitwise).

argv: process_id num_processes port checkpoint. Prints one JSON line: shards checked, leaves loaded.
"""

import json
import sys

import jax
import numpy as np
from dist_ckpt_testdata import reference_arrays
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dist_ckpt

process_id, num_processes, port, checkpoint = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id)
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
ref = reference_arrays()
specs = {
    "embed": P("model", "data"),
    "mlp": P("data"),
    "bias": P(),
    "mu": P(None, "model"),
    "key": P("model"),
    "mask": P("data", "model"),
}
target = {
    name: jax.ShapeDtypeStruct(ref[name].shape, ref[name].dtype, sharding=NamedSharding(mesh, spec))
    for name, spec in specs.items()
}
loaded = dist_ckpt.load(checkpoint, target, subtree="['flat']")
checked = 0
for name, array in loaded.items():
    assert array.sharding == target[name].sharding, name
    for shard in array.addressable_shards:
        assert np.asarray(shard.data).tobytes() == ref[name][shard.index].tobytes(), (name, shard.index)
        checked += 1
print(json.dumps({"process": process_id, "shards_checked": checked, "leaves": sorted(loaded)}), flush=True)
jax.distributed.shutdown()
