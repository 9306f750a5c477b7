"""A two-source mixture with a stage change, end to end with the real CLI: killed with SIGKILL mid-run, resumed,
and bitwise equal to an uninterrupted run; per-source eval losses and data metrics in metrics.jsonl, TensorBoard
and wandb (offline, read back from its run file), and from `lm-train eval`; the build's per-source preprocessing
counts against the finished caches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sysconfig
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import dist_ckpt
import shard_cache
import trackers

pytestmark = pytest.mark.slow

SEQ_LEN, BATCH, BLOCK, STEPS, STAGE = 32, 8, 16, 12, 5
WEIGHTS = [[0, {"email": 0.75, "json": 0.25}], [STAGE, {"email": 0.25, "json": 0.75}]]
PREPROCESSING = ("docs", "tokens", "shards_finished")


def _write_domain(folder: Path, name: str, package: str) -> None:
    """One domain: a standard-library package's files as jsonl, every fourth one held out for validation."""
    files = sorted((Path(sysconfig.get_paths()["stdlib"]) / package).glob("*.py"))
    texts = [p.read_text(encoding="utf-8") for p in files if p.stat().st_size > 200]
    for split, chosen in (("train", [t for i, t in enumerate(texts) if i % 4]), ("valid", texts[::4])):
        with open(folder / f"{name}_{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in chosen)


@pytest.fixture(scope="module")
def mixture_config(tiny_project) -> Path:
    folder = tiny_project.root / "mix"
    folder.mkdir(exist_ok=True)
    _write_domain(folder, "email", "email")
    _write_domain(folder, "json", "json")
    sources = "\n".join(
        f'    {n}: {{train_urls: ["mix/{n}_train.jsonl"], validation_urls: ["mix/{n}_valid.jsonl"]{extra}}}'
        for n, extra in (("email", ""), ("json", ", shuffle: false"))
    )
    text = tiny_project.config.read_text(encoding="utf-8").split("model:", 1)[1]
    return tiny_project.write_config(
        "mixture.yaml",
        f"""\
data:
  configs:
{sources}
  train_weights: {json.dumps(WEIGHTS)}
  mixture_block_size: {BLOCK}
  tokenizer: tokenizer.json
  cache_dir: mixcache
  chunk_size: 8
  shuffle: 64
model:{text}""",
    )


def _leaves(checkpoint: Path) -> dict[str, np.ndarray]:
    return {k: v for k, v in dist_ckpt.load(checkpoint, progress=False).items() if k.startswith(".model")}


def _by_step(run_dir: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for row in trackers.read_jsonl(run_dir / "metrics.jsonl"):
        rows.setdefault(row["step"], {}).update(row)
    return rows


def _cache_counts(cache: Path) -> dict[str, float]:
    """docs, tokens and finished shards of a finished cache, read with plain pyarrow and json."""
    ledger = json.loads((cache / "ledger.json").read_text(encoding="utf-8"))
    assert ledger["finished"], cache
    tables = [pq.read_table(path, columns=["input_ids"]) for path in sorted(cache.glob("chunks/*/*.parquet"))]
    tokens = sum(len(ids) for table in tables for ids in table.column("input_ids").to_pylist())
    shards = sum(shard["done"] for shard in ledger["shards"])
    return {"docs": float(sum(t.num_rows for t in tables)), "tokens": float(tokens), "shards_finished": float(shards)}


def _wait_for_checkpoint(process: subprocess.Popen, checkpoints: Path, name: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with warnings.catch_warnings():  # a checkpoint being written is "torn" until committed
            warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)
            latest = dist_ckpt.latest(checkpoints) if checkpoints.exists() else None
        if latest is not None and latest.name == name:
            return
        time.sleep(0.05)
    if process.poll() is not None:
        pytest.fail("the run ended before the kill: " + process.stderr.read().decode()[-3000:])
    pytest.fail(f"no {name} under {checkpoints} within {timeout} s")


def test_mixture_killed_and_resumed_is_bitwise_equal_with_per_source_metrics(
    tiny_project, mixture_config, cli, lm_train_command, offline_wandb_env, wandb_reader, tmp_path
):
    tensorboard = ["--trainer.tracker", "{type: tensorboard}"]
    reference = tiny_project.root / "runs" / "mix-reference"
    both = ["--trainer.tracker", "[{type: tensorboard}, {type: wandb, mode: offline}]"]  # the same run, both sinks
    wandb_env = offline_wandb_env(tmp_path / "wandb-home")
    args = ["run", str(mixture_config), "--trainer.run_dir", str(reference), *both]
    first = cli(args, tiny_project.root, env=wandb_env)
    assert first.returncode == 0, first.output[-5000:]

    killed = tiny_project.root / "runs" / "mix-killed"
    env = dict(os.environ, LM_TRAIN_STEP_DELAY_S="0.4")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    command = [*lm_train_command, "run", str(mixture_config), "--trainer.run_dir", str(killed), *tensorboard]
    process = subprocess.Popen(command, cwd=tiny_project.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_checkpoint(process, killed / "checkpoints", "step-4")  # before the stage change at step 5
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL
    resumed_from = dist_ckpt.latest(killed / "checkpoints")
    assert resumed_from.name in {"step-4", "step-6"}
    again = cli(["run", str(mixture_config), "--trainer.run_dir", str(killed), *tensorboard], tiny_project.root)
    assert again.returncode == 0, again.output[-5000:]
    assert f"resuming from {resumed_from}" in again.output

    left, right = _leaves(reference / "checkpoints/step-12"), _leaves(killed / "checkpoints/step-12")
    assert left.keys() == right.keys() and left
    for key in left:
        assert left[key].dtype == right[key].dtype and left[key].tobytes() == right[key].tobytes(), key
    ours, theirs = _by_step(reference), _by_step(killed)
    for step in (10, 12):  # logged by the resumed process only, so they come from the resumed state
        for key, value in ours[step].items():
            # (the build's counts are the first run's: the resumed ones found the caches finished)
            if not key.startswith(("throughput/", "time/", "preprocessing/")) and key != "timestamp":
                assert theirs[step][key] == value, (step, key)

    # The first run built the caches while it trained: its last preprocessing counts are the finished caches'.
    last: dict[str, float] = {}
    for step in sorted(ours):
        last.update({k: v for k, v in ours[step].items() if k.startswith("preprocessing/")})
    totals = {k for k in last if k.count("/") == 1}
    assert totals == {f"preprocessing/{k}" for k in (*PREPROCESSING, "tokens_per_second")}
    for name in ("email", "json"):
        [cache] = (tiny_project.root / "mixcache" / name).glob("*/train")
        for key, value in _cache_counts(cache).items():
            assert last[f"preprocessing/{name}/{key}"] == value, (name, key)
        assert last[f"preprocessing/{name}/tokens_per_second"] > 0
    for key in PREPROCESSING:
        assert last[f"preprocessing/{key}"] == last[f"preprocessing/email/{key}"] + last[f"preprocessing/json/{key}"]
    assert not any(k.startswith("preprocessing/") for k in theirs[12])

    # Per-source accounting against shard-cache's own layout of the same schedule.
    schedule = shard_cache.parse_train_weights(WEIGHTS, ["email", "json"])
    layout = shard_cache.MixtureLayout(schedule, batch_size=BATCH, block_size=BLOCK, seed=1)
    for step in (4, 6, 12):
        for name in ("email", "json"):
            assert ours[step][f"data/{name}/tokens_seen"] == layout.examples_seen(step)[name] * SEQ_LEN
            assert ours[step][f"data/{name}/weight"] == pytest.approx(schedule.weights_at(step - 1)[name])
    assert ours[4]["data/email/weight"] == 0.75 and ours[6]["data/email/weight"] == 0.25

    # eval/<name>/loss for each source, and eval/loss their mixture by the weights in force.
    for step in (6, 12):
        email, json_loss = ours[step]["eval/email/loss"], ours[step]["eval/json/loss"]
        assert email != json_loss and np.isfinite([email, json_loss]).all()
        assert ours[step]["eval/loss"] == pytest.approx(0.25 * email + 0.75 * json_loss, rel=1e-6)

    # `lm-train eval` of the final checkpoint prints the same per-source and weighted losses.
    evaluated = cli(["eval", str(mixture_config), "--trainer.run_dir", str(reference)], tiny_project.root)
    assert evaluated.returncode == 0, evaluated.output[-5000:]
    printed = {line.split()[0]: float(line.split()[1]) for line in evaluated.stdout.splitlines() if "/loss" in line}
    for key in ("eval/loss", "eval/email/loss", "eval/json/loss"):
        assert printed[key] == pytest.approx(ours[12][key], abs=1e-3), key

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(reference / "tensorboard"))
    events.Reload()
    for key in ("eval/email/loss", "eval/json/loss", "eval/loss", "data/json/tokens_seen", "data/json/weight"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        assert logged[12] == pytest.approx(ours[12][key], rel=1e-6), key

    [run_file] = reference.glob("wandb/offline-run-*/run-*.wandb")
    history: dict[int, dict] = {}
    for row in wandb_reader(run_file)["history"]:  # a step's metrics may come in more than one row
        history.setdefault(row.get("_step"), {}).update(row)
    for key in ("eval/email/loss", "eval/json/loss", "eval/loss", "data/json/tokens_seen", "data/json/weight"):
        assert history[12][key] == pytest.approx(ours[12][key], rel=1e-6), key
