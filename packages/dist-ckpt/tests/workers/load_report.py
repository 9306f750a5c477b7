"""Worker: load a checkpoint (flat) and print one JSON line: the error's type, url or file, and message.

argv: checkpoint. Run by tests that change what this process may do (e.g. without root's file access).
"""

import json
import sys

import dist_ckpt

try:
    dist_ckpt.load(sys.argv[1], progress=False)
    report = {"type": None}
except dist_ckpt.CheckpointError as error:
    report = {
        "type": type(error).__name__,
        "url": getattr(error, "url", None) or getattr(error, "file", None),
        "message": str(error),
        "reason": getattr(error, "reason", None),
    }
print(json.dumps(report), flush=True)
