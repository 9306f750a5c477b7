"""Time from `lm-train run configs/gpt2_nano.yaml` on a cold cache to step 1, and its parts.

Prints one JSON line. Run: `uv run python bench/time_to_first_step.py` (about 2-4 minutes on 2 cores).

Three measurements, each in a fresh Python process started from this one, each in its own temporary
directory holding a copy of configs/ (so the cache, the trained tokenizer and the run directory all start
empty; nothing outside the temporary directory is read or written but Ray's session files under /tmp/ray):

1. end to end, cold then warm: the real command, `lm-train run configs/gpt2_nano.yaml --trainer.num_train_steps 1
   --trainer.log_every 1 --trainer.run_dir run`. The figure is the wall time from launching it to the moment
   the step-1 line appears in run/metrics.jsonl (polled every 20 ms); the time until the process exits (after
   the end-of-run eval and checkpoint) is reported alongside. The warm run is the same command again, in the
   same directory with another run directory: tokenizer, data cache and JAX compilation cache present.
2. parts: the same steps, in the same order as `lm_train.run.loop.train`, driven by calling the library
   functions in one process (`--phases`), each timed: `imports` (jax, lm_train.run.state, shard_cache),
   `jax_init` (first array on the device), `config` (YAML + overrides), `tokenizer` (a byte-level BPE trained on
   the corpus, since the cache dir is cold), `ray_start` (shard_cache.ensure_ray, the local Ray that the cache
   build starts, with `--cache-build ray`; by default nano's 12 MB are tokenized in-process), `start_builds`
   (prepare_data with the tokenizer and Ray ready), `first_batch` (until the
   batch of step 0 can be read: the build has committed enough chunks; with nano's `shuffle: 2048` that is
   the first era of 2048 examples), `init_state`, `compile` (lower + compile of the jitted train step) and
   `first_step` (running it). Their sum is comparable with (1); the processes differ, so they differ a little.
3. reference: `python -c "import jax; jax.numpy.ones(1)"` in the same interpreter (the least any JAX program
   pays before its first step), best of 2. ratio = time to step 1 / that reference: how many bare JAX
   start-ups our first step costs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO_ROOT, emit, log

CONFIG = "configs/gpt2_nano.yaml"
OVERRIDES = ["--trainer.num_train_steps", "1", "--trainer.log_every", "1"]
BASELINE = "import jax; jax.numpy.ones(1).block_until_ready()"


def cold_dir(parent: Path, name: str) -> Path:
    """A fresh directory holding a copy of configs/: relative cache and run paths then land inside it."""
    work = parent / name
    work.mkdir()
    shutil.copytree(REPO_ROOT / "configs", work / "configs")
    return work


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a user's run: the compilation cache the app keeps by default
    return env


def baseline_seconds(repeats: int) -> float:
    """Wall seconds of a fresh `python -c "import jax; jax.numpy.ones(1)"`, best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", BASELINE], check=True, env=child_env(), timeout=300)
        best = min(best, time.perf_counter() - start)
    return best


def lm_train_command() -> list[str]:
    script = Path(sys.executable).parent / "lm-train"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lm_train"]


def end_to_end(work: Path, timeout: float, run: str = "run") -> dict[str, float | bool | None]:
    """Launch the real command (run directory `run`); seconds to the step-1 metrics line and to the process's
    exit, and whether its train step came from the compilation cache."""
    metrics = work / run / "metrics.jsonl"
    log_path = work / f"{run}.log"
    log_file = log_path.open("w")
    start = time.perf_counter()
    command = [*lm_train_command(), "run", CONFIG, *OVERRIDES, "--trainer.run_dir", run]
    proc = subprocess.Popen(command, cwd=work, env=child_env(), stdout=log_file, stderr=log_file)
    first_step = None
    try:
        while proc.poll() is None and time.perf_counter() - start < timeout:
            if first_step is None and _has_step_one(metrics):
                first_step = time.perf_counter() - start
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"lm-train did not finish within {timeout} s; see {log_path}")
    finally:
        log_file.close()
    exit_s = time.perf_counter() - start
    if first_step is None and _has_step_one(metrics):
        first_step = exit_s  # the line appeared between two polls, just before the exit
    output = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"lm-train exited with {proc.returncode}:\n{output[-2000:]}")
    cached = "train step: loaded from the compilation cache" in output
    return {"to_step_1_s": first_step, "to_exit_s": exit_s, "step_from_compilation_cache": cached}


def _has_step_one(metrics: Path) -> bool:
    try:
        text = metrics.read_text()
    except FileNotFoundError:
        return False
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line still being written
        if record.get("step") == 1 and "train/loss" in record:
            return True
    return False


def phases_in_process() -> None:
    """Run in the cold directory (cwd): time each phase of trainer.train up to step 1; print them as JSON."""
    times: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        times[name] = round(now - mark, 3)
        mark = now

    import equinox as eqx
    import jax
    import numpy as np

    import named_tensors as nt
    import shard_cache
    from lm_train.config import load_train_config
    from lm_train.data.batches import ProcessSlice, TrainBatches
    from lm_train.data.caches import prepare_data
    from lm_train.data.inputs import resolve_inputs
    from lm_train.data.tokenizer import provide_tokenizer
    from lm_train.optim import build_optimizer
    from lm_train.run.batch import TokenBatch
    from lm_train.run.mesh import check_batch_fits, plan_mesh
    from lm_train.run.precision import parse_policy
    from lm_train.run.state import init_state
    from lm_train.run.step import StepSettings, make_train_step

    lap("imports")
    jax.numpy.ones(1).block_until_ready()
    lap("jax_init")
    config, _ = load_train_config([Path(CONFIG)], OVERRIDES)
    lap("config")
    # prepare_data's own first step, on its own: the tokenizer is trained here because the cache is cold.
    provide_tokenizer(config.data, resolve_inputs(config.data), progress=False)
    lap("tokenizer")
    if config.data.cache_build == "ray":
        shard_cache.ensure_ray()
    lap("ray_start")  # nothing to start where the build tokenizes in this process (nano's 12 MB, by default)
    data = prepare_data(config.data, background=True, progress=False)
    lap("start_builds")
    trainer = config.trainer
    Pos = config.model.Pos
    batches = TrainBatches.from_caches(
        data, config.data, Pos.size, trainer.train_batch_size, trainer.seed, ProcessSlice()
    )
    local = batches.batch(0)
    lap("first_batch")
    plan = plan_mesh(trainer)
    Vocab = nt.Axis("vocab", data.vocab_size())
    optimizer, schedule = build_optimizer(config.optimizer, trainer.num_train_steps)
    state = init_state(config, plan, Vocab, optimizer)
    jax.block_until_ready(state)
    lap("init_state")
    settings = StepSettings(
        parse_policy(trainer.mp), check_batch_fits(trainer, plan, 1), config.z_loss_weight, trainer.batch_axis
    )
    array = jax.make_array_from_process_local_data(plan.batch_sharding(), np.asarray(local, np.int32))
    ids = nt.NamedArray(array, (nt.Axis(trainer.batch_axis, array.shape[0]), Pos))
    with plan.mesh, nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        step = eqx.filter_jit(make_train_step(optimizer, settings, schedule), donate="all")
        compiled = step.lower(state, TokenBatch(ids)).compile()
    lap("compile")
    with plan.mesh, nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        state, metrics = compiled(state, TokenBatch(ids))
    float(metrics["train/loss"])
    lap("first_step")
    print("PHASES " + json.dumps(times), flush=True)
    # Stop here rather than wait for the rest of the cache build: shut our Ray down, skip the build thread.
    import ray

    ray.shutdown()
    os._exit(0)


def phases(work: Path, timeout: float) -> tuple[dict[str, float], float]:
    """The parts, from a fresh process in the cold directory `work`; also that process's total wall time."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--phases-in-process", "--cache-build", OVERRIDES[-1]],
        cwd=work,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    total = time.perf_counter() - start
    for line in out.stdout.splitlines():
        if line.startswith("PHASES "):
            return json.loads(line[len("PHASES ") :]), total
    raise RuntimeError(f"the phase run failed ({out.returncode}):\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases-in-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-phases", action="store_true", help="only the end-to-end run and the reference")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds allowed to each child run")
    parser.add_argument(
        "--cache-build",
        choices=["auto", "in_process", "ray"],
        default="auto",
        help="data.cache_build of the runs (ray: the cache built by Ray tasks, as before shard-cache 0.8)",
    )
    args = parser.parse_args()
    OVERRIDES.extend(["--data.cache_build", args.cache_build])
    if args.phases_in_process:
        phases_in_process()
        return

    with tempfile.TemporaryDirectory(prefix="bench-ttfs-") as tmp:
        parent = Path(tmp)
        baseline = baseline_seconds(2)
        log(f"time_to_first_step: reference (import jax + first array) {baseline:.2f} s")
        work = cold_dir(parent, "e2e")
        e2e = end_to_end(work, args.timeout)
        log(f"time_to_first_step: end to end, cold {e2e}")
        # Warm: the same command again in a new run directory, with the tokenizer, the data cache and the
        # compilation cache that the cold run left.
        warm = end_to_end(work, args.timeout, run="warm")
        log(f"time_to_first_step: end to end, warm {warm}")
        parts, parts_total = ({}, None) if args.skip_phases else phases(cold_dir(parent, "phases"), args.timeout)
        log(f"time_to_first_step: parts {parts}")
    to_step = e2e["to_step_1_s"]
    emit(
        "time_to_first_step",
        {
            "config": CONFIG,
            "overrides": " ".join(OVERRIDES),
            "to_step_1_s": round(to_step, 2) if to_step is not None else None,
            "to_exit_s": round(e2e["to_exit_s"], 2),
            "warm_to_step_1_s": None if warm["to_step_1_s"] is None else round(warm["to_step_1_s"], 2),
            "warm_step_from_compilation_cache": warm["step_from_compilation_cache"],
            "parts_s": parts,
            "parts_sum_s": round(sum(parts.values()), 2) if parts else None,
            "parts_process_wall_s": round(parts_total, 2) if parts_total else None,
            "parts_how": "library functions called in a fresh process, timed in trainer.train's order",
        },
        reference={"import_jax_first_array_s": round(baseline, 3)},
        ratio=None if to_step is None else to_step / baseline,
        ratio_means="time to step 1 / time of a bare `import jax; jnp.ones(1)` process (lower is better)",
    )


if __name__ == "__main__":
    main()
