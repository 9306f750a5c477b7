"""`lm-train doremi` end to end on three synthetic domains: an easy one (a repeated short pattern), a learnable one
(standard-library source) and an incompressible one (random characters). DoReMi moves weight off the random
domain; a run killed with SIGKILL and resumed equals an uninterrupted one bit for bit (parameters, domain weights
and their running sum); the averaged weights' file is a config `lm-train run` takes."""

from __future__ import annotations

import json
import os
import signal
import string
import subprocess
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

import dist_ckpt
import trackers

pytestmark = pytest.mark.slow

STEPS, DOMAINS = 10, ("easy", "noise", "text")


def _write_domains(folder: Path) -> None:
    rng = np.random.default_rng(0)
    texts = {
        "easy": ["ab cd " * 40 for _ in range(16)],
        "noise": ["".join(rng.choice(list(string.ascii_letters + string.digits), 400)) for _ in range(16)],
        "text": [
            p.read_text(encoding="utf-8")[:4000]
            for p in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))
        ],
    }
    for name, docs in texts.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")


@pytest.fixture(scope="module")
def doremi_config(tiny_project) -> Path:
    folder = tiny_project.root / "domains"
    folder.mkdir(exist_ok=True)
    _write_domains(folder)
    sources = "\n".join(f'    {n}: {{train_urls: ["domains/{n}.jsonl"]}}' for n in DOMAINS)
    model = tiny_project.config.read_text(encoding="utf-8").split("model:", 1)[1].split("trainer:", 1)[0]
    return tiny_project.write_config(
        "doremi.yaml",
        f"""\
data:
  configs:
{sources}
  train_weights: {{easy: 1, noise: 1, text: 1}}
  mixture_block_size: 48
  tokenizer: tokenizer.json
  cache_dir: domaincache
  chunk_size: 8
model:{model}trainer:
  seed: 1
  num_train_steps: {STEPS}
  train_batch_size: 16
  log_every: 1
  checkpointer:
    save_interval: 1h
    keep:
      - every: 2
optimizer:
  learning_rate: 1.0e-2
  warmup: 0
doremi:
  step_size: 1.0
""",
    )


def _leaves(checkpoint: Path) -> dict[str, np.ndarray]:
    return dict(dist_ckpt.load(checkpoint, progress=False))


def _by_step(run_dir: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for row in trackers.read_jsonl(run_dir / "metrics.jsonl"):
        rows.setdefault(row["step"], {}).update(row)
    return rows


def _kill_after(process: subprocess.Popen, checkpoints: Path, name: str) -> None:
    import time

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        with warnings.catch_warnings():  # a checkpoint being written is "torn" until committed
            warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)
            latest = dist_ckpt.latest(checkpoints) if checkpoints.exists() else None
        if latest is not None and latest.name == name:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            return
        time.sleep(0.05)
    process.kill()
    pytest.fail(f"no {name} before the run ended: " + process.stderr.read().decode()[-3000:])


def test_doremi_moves_weight_off_noise_and_resumes_bitwise(tiny_project, doremi_config, cli, lm_train_command):
    root = tiny_project.root
    missing = cli(["doremi", str(doremi_config), "--reference", "runs/nope"], root)
    assert missing.returncode == 2 and "--reference" in missing.stderr and "runs/nope" in missing.stderr
    assert "Traceback" not in missing.output

    reference = root / "runs" / "doremi-reference"  # the reference: the same model on the uniform mixture, longer
    ref = cli(["run", str(doremi_config), "--trainer.run_dir", str(reference), "--trainer.num_train_steps", "40"], root)
    assert ref.returncode == 0, ref.output[-5000:]

    whole = root / "runs" / "doremi-whole"
    first = cli(["doremi", str(doremi_config), "--reference", str(reference), "--trainer.run_dir", str(whole)], root)
    assert first.returncode == 0, first.output[-5000:]

    wrong = root / "runs" / "doremi-wrong"  # a reference of another shape than the proxy: named, nothing written
    args = ["doremi", str(doremi_config), "--reference", str(reference), "--trainer.run_dir", str(wrong)]
    mismatch = cli([*args, "--model.hidden_dim", "64"], root)
    assert mismatch.returncode == 2 and "Traceback" not in mismatch.output, mismatch.output[-3000:]
    assert "does not fit the config's model" in mismatch.stderr and str(reference) in mismatch.stderr
    assert not wrong.exists()

    killed = root / "runs" / "doremi-killed"
    args = ["doremi", str(doremi_config), "--reference", str(reference), "--trainer.run_dir", str(killed)]
    env = dict(os.environ, LM_TRAIN_STEP_DELAY_S="0.4")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    process = subprocess.Popen(
        [*lm_train_command, *args], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _kill_after(process, killed / "checkpoints", "step-4")
    assert process.returncode == -signal.SIGKILL
    resumed_from = dist_ckpt.latest(killed / "checkpoints")
    again = cli(args, root)
    assert again.returncode == 0, again.output[-5000:]
    assert f"resuming from {resumed_from}" in again.output

    # Parameters, optimizer state, domain weights and their running sum: bit for bit.
    left, right = _leaves(whole / f"checkpoints/step-{STEPS}"), _leaves(killed / f"checkpoints/step-{STEPS}")
    assert left.keys() == right.keys() and any(k.startswith(".kind_state") for k in left)
    for key in left:
        assert left[key].dtype == right[key].dtype and left[key].tobytes() == right[key].tobytes(), key
    ours, theirs = _by_step(whole), _by_step(killed)
    for step in range(int(resumed_from.name.split("-")[1]) + 1, STEPS + 1):
        for name in DOMAINS:
            for key in (f"doremi/{name}/weight", f"doremi/{name}/excess_loss"):
                assert theirs[step][key] == ours[step][key], (step, key)

    # The weights in force were logged each step; the file holds their average, and it moved off the noise.
    logged = {n: np.mean([ours[s][f"doremi/{n}/weight"] for s in range(1, STEPS + 1)]) for n in DOMAINS}
    written = yaml.safe_load((whole / "doremi_weights.yaml").read_text(encoding="utf-8"))["data"]["train_weights"]
    assert written.keys() == set(DOMAINS)
    for name in DOMAINS:
        assert written[name] == pytest.approx(logged[name], rel=1e-5), name
    assert sum(written.values()) == pytest.approx(1.0, abs=1e-5)
    # From uniform (1/3 each), the incompressible domain loses its weight: its excess loss is the smallest at the
    # start (the reference cannot do much better than a unigram either), while the easy domain's is the largest.
    assert written["noise"] < 0.2 and ours[STEPS]["doremi/noise/weight"] < 0.2, written
    assert (killed / "doremi_weights.yaml").read_bytes() == (whole / "doremi_weights.yaml").read_bytes()

    from lm_train.config import load_train_config

    config, _ = load_train_config([doremi_config, whole / "doremi_weights.yaml"], [])
    assert config.data.train_weights == written
