"""Worker: a background write fails for real (the file-size limit refuses the chunk); report what surfaced.

argv: process_id num_processes port root. Prints one JSON line.
"""

import json
import resource
import signal
import sys
import time
from datetime import timedelta

import numpy as np

import dist_ckpt

root = sys.argv[4]
checkpointer = dist_ckpt.Checkpointer(root, save_interval=timedelta(hours=1), progress=False)
checkpointer.on_step({"w": np.arange(4, dtype=np.float32)}, 1, force=True)
checkpointer.wait()

soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG, not a signal
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
report = {"save_returned": checkpointer.on_step({"w": np.ones((512, 1024), np.float32)}, 2, force=True)}
time.sleep(1.0)  # let the background write fail; the next call must raise even though it saves nothing
try:
    report["saved_at_3"] = checkpointer.on_step({"w": np.ones((512, 1024), np.float32)}, 3)
    report["next_call_error"] = None
except dist_ckpt.BackgroundSaveError as error:
    report["next_call_error"] = f"{type(error).__name__}: {error}"
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
try:
    checkpointer.wait()
    report["wait_after_error"] = "ok"
except dist_ckpt.CheckpointError as error:
    report["wait_after_error"] = str(error)
checkpointer.on_step({"w": np.arange(4, dtype=np.float32)}, 3, force=True)
checkpointer.wait()
print(json.dumps(report), flush=True)
