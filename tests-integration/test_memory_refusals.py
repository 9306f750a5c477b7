"""`lm-train run` with a memory limit the run will not fit: refused before it compiles, exit 2, one paragraph, the
run directory left as it was; --skip-memory-check runs it anyway."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_resumed_run_over_the_memory_limit_is_refused_before_compiling_and_its_run_dir_is_kept(
    tiny_project, cli, tmp_path
):
    run_dir = tiny_project.root / "runs" / "memory-limit"
    base = ["run", str(tiny_project.config), "--trainer.run_dir", str(run_dir)]
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # the estimates this test makes stay with it
    first = cli([*base, "--trainer.num_train_steps", "2"], tiny_project.root, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _files(run_dir)
    assert any(name.startswith("checkpoints/") for name in before)

    limited = {**env, "LM_TRAIN_MEMORY_LIMIT": "16KiB"}
    refused = cli([*base, "--trainer.num_train_steps", "4"], tiny_project.root, env=limited)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and refused.stderr.count("will not fit in memory") == 1
    (error,) = errors
    assert (
        "the plan's peak estimate is" in error and "the limit is 16.00 KiB per device (LM_TRAIN_MEMORY_LIMIT)" in error
    )
    assert "--skip-memory-check" in error
    assert "train step:" not in refused.stderr  # nothing compiled: the line that times the compile never came
    assert _files(run_dir) == before  # not a byte of the run directory changed

    ran = cli([*base, "--trainer.num_train_steps", "4", "--skip-memory-check"], tiny_project.root, env=limited)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step-4").is_dir()
