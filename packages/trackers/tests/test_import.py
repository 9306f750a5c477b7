"""`import trackers` stays light: no jax, wandb or tensorboardX until a backend or jit_log needs them."""

from __future__ import annotations

import json
import subprocess
import sys


def _imported_after(code: str) -> list[str]:
    program = (
        f"{code}\nimport json, sys\n"
        "print(json.dumps([m for m in ('jax', 'wandb', 'tensorboardX', 'numpy') if m in sys.modules]))"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_trackers_imports_no_heavy_library():
    assert _imported_after("import trackers; trackers.JsonlConfig(); trackers.NoopTracker()") == []


def test_jit_log_imports_jax_on_first_use():
    assert "jax" in _imported_after("import trackers; trackers.jit_log")
