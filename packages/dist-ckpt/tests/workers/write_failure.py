"""Worker: a background write fails for real (the file-size limit refuses the chunk); report what surfaced.

argv: process_id num_processes port root. Prints one JSON line.
"""

import json
import resource
import signal
import sys

import numpy as np

import dist_ckpt

root = sys.argv[4]
dist_ckpt.save({"w": np.arange(4, dtype=np.float32)}, f"{root}/step-1", step=1, block=True)

soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG, not a signal
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
dist_ckpt.save({"w": np.ones((512, 1024), np.float32)}, f"{root}/step-2", step=2)  # a 2 MiB chunk
report = {"save_returned": True}
try:
    dist_ckpt.wait()
    report["next_call_error"] = None
except dist_ckpt.BackgroundSaveError as error:
    report["next_call_error"] = f"{type(error).__name__}: {error}"
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
try:
    dist_ckpt.wait()
    report["wait_after_error"] = "ok"
except dist_ckpt.CheckpointError as error:
    report["wait_after_error"] = str(error)
dist_ckpt.save({"w": np.arange(4, dtype=np.float32)}, f"{root}/step-3", step=3, block=True)
print(json.dumps(report), flush=True)
