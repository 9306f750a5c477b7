"""Worker: one process of a jax.distributed job running a Checkpointer whose clock disagrees per process.

argv: process_id num_processes port steps root [root...]. For each root (a directory or a bucket URL), in turn,
prints one JSON line per step, {"step", "saved", "root"}, and one per checkpoint this process deleted,
{"deleted", "root"}.
Process p's fake clock reads (3 + 4 * p) * step + 1000 * p seconds: the clocks disagree on both offset and
rate, as hosts' clocks do, and only process 0's may matter.
"""

import json
import logging
import sys
from datetime import timedelta

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dist_ckpt

process_id, num_processes, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
steps, roots = int(sys.argv[4]), sys.argv[5:]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id)
mesh = Mesh(np.array(jax.devices()), ("data",))
weights = np.arange(16, dtype=np.float32)

current_step = 0


def fake_clock() -> float:
    return float((3 + 4 * process_id) * current_step + 1000 * process_id)


class PrintDeletions(logging.Handler):
    """Reports the Checkpointer's deletions, which only process 0 may make, each once."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("deleted temporary checkpoint"):
            print(json.dumps({"deleted": str(record.args[0]), "root": current_root}), flush=True)


logging.getLogger("dist_ckpt").addHandler(PrintDeletions())
logging.getLogger("dist_ckpt").setLevel(logging.INFO)
for current_root in roots:
    current_step = 0
    checkpointer = dist_ckpt.Checkpointer(
        current_root, save_interval=timedelta(seconds=10), keep=[{"every": 5}], clock=fake_clock, progress=False
    )
    for step in range(1, steps + 1):
        current_step = step
        values = weights + np.float32(step)
        state = {
            "w": jax.make_array_from_callback((16,), NamedSharding(mesh, P("data")), lambda i, v=values: v[i]),
            "step": step,
        }
        saved = checkpointer.on_step(state, step)
        print(json.dumps({"step": step, "saved": saved, "root": current_root}), flush=True)
    checkpointer.wait()
jax.distributed.shutdown()
