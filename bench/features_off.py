"""What the optional features of a run cost the train step when they are off: the line `train_step.features_off`.

bench/train_step.py runs it (on the nano shape, unless `--no-features-off`); it is a helper, not a benchmark.

Program: `lm_train.run.loop.compiled_train_step`, the function `lm-train run`'s loop builds its step with (watch from
trainer.watch, the objective from the training kind, fcm_prob in the step settings), is given a config in which
one feature at a time is configured but off (trainer.watch with targets and nothing to log, fcm_prob 0,
trainer.profiler with steps but enabled false, trainer.eval_harness with no task; DoReMi's objective state is
None for `lm-train run`). Its lowered program (StableHLO text) is compared with that of the bench's bare
`make_train_step(optimizer, settings, schedule)`, both wrapped alike in CompiledStep for the same state layout.
Turning trainer.watch or fcm_prob on must change the text: that shows the comparison can fail.

Host: the loop's per-step hooks for the host-side features (profiler None, harness None, preprocessing metrics
read at log steps only, the bar's `dispatched`), as `_run_loop` calls them, around the same compiled step,
timed against a bare loop of that step, in alternating rounds. Reported: the hooks' own host time per step
(timed around them, microseconds), and the hooked loop's steps/s over the bare loop's (the ratio).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import Any

import jax
import numpy as np
from common import emit, log, median

import trackers
from lm_train.config.trainer_config import WatchConfig
from lm_train.config.watching_config import EvalHarnessConfig, ProfilerConfig
from lm_train.data.caches import PreparedData
from lm_train.run.compiled import CompiledStep, StateLayout
from lm_train.run.distributed import DistributedInfo
from lm_train.run.loop import compiled_train_step, preprocessing_metrics
from lm_train.run.preflight import prepare_run
from lm_train.run.profiling import StepProfiler
from lm_train.run.progress import TrainingProgress
from lm_train.run.state import init_state, state_shapes
from lm_train.run.step import make_train_step
from lm_train.tools.harness.during_training import harness_during_training

OFF = {
    "all_defaults": {},
    "watch": {"trainer.watch": WatchConfig(watch_targets=("grads", "params"), include_norms=False)},
    "fcm_prob": {"fcm_prob": 0.0},
    "profiler": {"trainer.profiler": ProfilerConfig(start_step=1, num_steps=2, enabled=False)},
    "eval_harness": {"trainer.eval_harness": EvalHarnessConfig(tasks=(), every=1)},
}
ON = {
    "watch": {"trainer.watch": WatchConfig(watch_targets=("grads",), interval=1)},
    "fcm_prob": {"fcm_prob": 0.1},
}
LOG_EVERY = 10  # TrainerConfig's default log_every


def with_changes(config: Any, changes: dict[str, Any]) -> Any:
    """The config with `trainer.<key>` and top-level keys replaced."""
    trainer = {k.split(".", 1)[1]: v for k, v in changes.items() if k.startswith("trainer.")}
    top = {k: v for k, v in changes.items() if not k.startswith("trainer.")}
    return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, **trainer), **top)


def program_text(step: Any, target: Any, batch_size: int) -> str:
    """The StableHLO text of a CompiledStep lowered for the state's shapes and a batch of input_ids."""
    return step.lower(target, batch_size).as_text()


@dataclasses.dataclass
class Hooks:
    """What `_run_loop` holds for the host-side features, each as it is when off."""

    profiler: StepProfiler | None
    harness: Any
    bar: TrainingProgress
    data: PreparedData
    total: int


def hooked_steps(step: Any, state: Any, local: np.ndarray, start: int, count: int, hooks: Hooks) -> tuple[Any, float]:
    """`count` steps with the loop's per-step hooks of the host-side features, as `_run_loop` calls them; returns
    the state and the seconds spent in the hooks."""
    profiler, harness, bar = hooks.profiler, hooks.harness, hooks.bar
    in_hooks = 0.0
    for s in range(start, start + count):
        t0 = time.perf_counter()
        if profiler:
            profiler.before_step(s)
        t1 = time.perf_counter()
        state, metrics = step(state, local)
        t2 = time.perf_counter()
        if profiler:
            profiler.after_step(s, state)
        done = s + 1
        bar.dispatched(done, metrics["train/loss"])
        if done % LOG_EVERY == 0 or done == hooks.total:
            preprocessing_metrics(hooks.data)  # the host read alone: fetching the step's metrics is logging's cost
        if harness and (done % harness.every == 0 or done == hooks.total):
            harness.run(state.model, done, bar.note)
        in_hooks += (t1 - t0) + (time.perf_counter() - t2)
    return state, in_hooks


def bare_steps(step: Any, state: Any, local: np.ndarray, count: int) -> Any:
    for _ in range(count):
        state, _metrics = step(state, local)
    return state


def features_off(ours: Any, rounds: int, steps_per_round: int) -> dict:
    """Compare the programs and time the hooks; emits and returns the `train_step.features_off` line."""
    base = ours.config
    batch = base.trainer.train_batch_size
    dist = DistributedInfo(process_index=0, process_count=1, mode="single")
    with tempfile.TemporaryDirectory() as run_dir:
        config = with_changes(base, {"trainer.run_dir": run_dir})
        setup = prepare_run(config, dist)
        target = state_shapes(config, setup.plan, ours.Vocab, setup.optimizer)
        bare_fn = make_train_step(ours.optimizer, ours.settings, ours.schedule)  # the bench's own call, as timed
        bare = CompiledStep(bare_fn, StateLayout(target), setup.plan, config.model.Pos, config.trainer.batch_axis)
        start = time.perf_counter()
        reference = program_text(bare, target, batch)
        identical, differs = {}, {}
        for name, changes in OFF.items():
            changed = prepare_run(with_changes(config, changes), dist)
            identical[name] = program_text(compiled_train_step(changed, target), target, batch) == reference
        for name, changes in ON.items():
            changed = prepare_run(with_changes(config, changes), dist)
            differs[name] = program_text(compiled_train_step(changed, target), target, batch) != reference
        lower_s = time.perf_counter() - start
        log(f"train_step[features_off]: identical when off {identical}; differs when on {differs} ({lower_s:.1f} s)")

        step = compiled_train_step(setup, target)
        tracker = trackers.NoopTracker()
        total = 10**9  # the loop's last step never comes: only log steps add work
        profiler = StepProfiler.for_run(config.trainer.profiler, setup.paths.run_dir, (0, 1), tracker, log)
        harness = harness_during_training(setup, tracker)
        state = init_state(config, setup.plan, ours.Vocab, setup.optimizer)
        rng = np.random.default_rng(1)
        local = rng.integers(0, ours.Vocab.size, (batch, config.model.Pos.size), dtype=np.int32)
        state = bare_steps(step, state, local, 2)  # compiles (twice: donated outputs are laid out anew)
        jax.block_until_ready(state)
        bare_s, hooked_s, hook_s, done = [], [], 0.0, 2
        cpu = {"bare": 0.0, "hooked": 0.0}  # process CPU seconds: what neighbours' load disturbs least
        with TrainingProgress(total, done, enabled=False) as bar:
            # A cache found finished: no build to watch, as with a single source built before the run.
            hooks = Hooks(profiler, harness, bar, PreparedData("", "", None, []), total)
            for r in range(2 * rounds):
                began, cpu_began = time.perf_counter(), time.process_time()
                if (r % 2 == 0) == (r // 2 % 2 == 0):  # ABBA...: the first of each pair alternates
                    state = bare_steps(step, state, local, steps_per_round)
                    jax.block_until_ready(state)
                    bare_s.append(time.perf_counter() - began)
                    cpu["bare"] += time.process_time() - cpu_began
                else:
                    state, in_hooks = hooked_steps(step, state, local, done, steps_per_round, hooks)
                    jax.block_until_ready(state)
                    hooked_s.append(time.perf_counter() - began)
                    cpu["hooked"] += time.process_time() - cpu_began
                    hook_s += in_hooks
                done += steps_per_round
    steps = rounds * steps_per_round
    pairs = [b / h for b, h in zip(bare_s, hooked_s, strict=True)]
    return emit(
        "train_step.features_off",
        {
            "features_off_program_identical": identical,
            "feature_on_program_differs": differs,
            "lowering_s": round(lower_s, 2),
            "timed_steps_each": steps,
            "hooks_off_host_us_per_step": round(1e6 * hook_s / steps, 2),
            "bare_loop_step_us": round(1e6 * sum(bare_s) / steps, 1),
            "hooked_loop_step_us": round(1e6 * sum(hooked_s) / steps, 1),
            "hooks_share_of_step": round(hook_s / sum(bare_s), 6),
            "ratio_median_of_pairs": round(median(pairs), 4),
            "ratio_cpu_time": round(cpu["bare"] / cpu["hooked"], 4),
        },
        reference={"bare_loop_steps_per_s": round(steps / sum(bare_s), 2)},
        ratio=sum(bare_s) / sum(hooked_s),
        ratio_means="steps/s of the loop with its off features' hooks / a bare loop of the same compiled step "
        "(aim ~1, within the machine's noise; the hooks' own time is hooks_off_host_us_per_step)",
    )
