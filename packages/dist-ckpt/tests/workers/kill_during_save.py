"""Worker: commits step 1, then starts saving a large step 2 and waits to be killed in the middle of it.

argv: process_id num_processes port root. Prints "SAVING" once step 2's save() has returned.
"""

import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dist_ckpt

root = sys.argv[4]
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d"))
small = {"w": jax.device_put(np.arange(64, dtype=np.float32), sharding), "step": 1}
dist_ckpt.save(small, f"{root}/step-1", step=1, block=True)

# 8 arrays of 32 MiB: the write takes long enough to be killed in the middle of it.
big = {f"w{i}": jax.device_put(np.full((2048, 4096), i + 1, np.float32), sharding) for i in range(8)}
dist_ckpt.save(big, f"{root}/step-2", step=2, progress=False)
print("SAVING", flush=True)
time.sleep(120)
