import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_wheel_builds_installs_without_jax_and_runs_a_build(tmp_path, tools, tokenizer_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not on PATH; CI installs it (see .ci/run)")
    dist = tmp_path / "dist"
    for package in ("shard-cache", "storage-io"):  # storage-io: the workspace package it depends on
        subprocess.run(
            [uv, "build", "--package", package, "--wheel", "--out-dir", str(dist)],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    wheel = next(dist.glob("shard_cache-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "--python", "3.11", str(venv)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["VIRTUAL_ENV"] = str(venv)
    subprocess.run(
        [uv, "pip", "install", "--python", str(venv / "bin" / "python"), "--find-links", str(dist), str(wheel)],
        check=True,
        capture_output=True,
        env=env,
    )
    python = str(venv / "bin" / "python")
    probe = "import importlib.util as u; print(u.find_spec('jax') is None, u.find_spec('jaxlib') is None)"
    assert subprocess.run([python, "-c", probe], check=True, capture_output=True, text=True).stdout.split() == [
        "True",
        "True",
    ]
    tools.write_jsonl(tmp_path / "d_1.jsonl", tools.make_docs(9, seed=80))
    tools.write_jsonl(tmp_path / "d_2.jsonl", tools.make_docs(5, seed=81))
    cli = str(venv / "bin" / "shard-cache")
    env.update(RAY_ENABLE_UV_RUN_RUNTIME_ENV="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    build = subprocess.run(
        [
            cli,
            "build",
            str(tmp_path / "d_{1..2}.jsonl"),
            "--tokenizer",
            str(tokenizer_path),
            "--out",
            str(tmp_path / "cache"),
            "--chunk-size",
            "4",
            "--num-workers",
            "1",
            "--ray",  # the installed wheel's Ray runs the build (a corpus this small would not need it)
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    assert "2 shards, 5 chunks, 14 documents" in build.stdout
    verify = subprocess.run([cli, "verify", str(tmp_path / "cache")], capture_output=True, text=True, env=env)
    assert verify.returncode == 0 and "ok: 5 chunks checked" in verify.stdout
