"""`lm-train run`: check the config, prepare the data, start or resume the state, then step, log, evaluate,
export and checkpoint until the last step or a stop signal."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax

import dist_ckpt
import shard_cache
import trackers
from lm_train.config.loading import dump_config
from lm_train.config.schema import TrainLmConfig
from lm_train.data.caches import PreparedData
from lm_train.data.prefetch import Prefetcher
from lm_train.data.ray_cluster import ray_cluster
from lm_train.language_modeling import LANGUAGE_MODELING
from lm_train.post.lora_training import checkpointed
from lm_train.run.checkpoints import save_failed
from lm_train.run.chips import peak_flops_per_device
from lm_train.run.compile_cache import enable_compilation_cache, timed_compile
from lm_train.run.compiled import CompiledStep, StateLayout
from lm_train.run.console import RunConsole
from lm_train.run.distributed import initialize_distributed, wait_for_every_process
from lm_train.run.host_times import HostStepTimes
from lm_train.run.memory_guard import MemoryGuard, check_before_compile, with_run_loss_blocks
from lm_train.run.model_averaging import exported_model
from lm_train.run.preflight import RunSetup, prepare_run
from lm_train.run.profiling import StepProfiler
from lm_train.run.progress import TrainingProgress
from lm_train.run.run_dir import RunPaths
from lm_train.run.signals import StopRequest
from lm_train.run.start import write_run_dir
from lm_train.run.state import TrainerState
from lm_train.run.step import make_train_step
from lm_train.run.step_decisions import StepDecisions, checkpoint_clock
from lm_train.run.step_metrics import StepMetricsLogger
from lm_train.run.summary import run_summary
from lm_train.run.tracking import check_trackers_ready, run_tracker
from lm_train.run.training_kind import TrainingKind
from lm_train.run.watch import make_watch
from lm_train.run.watchdog import DECISION, DEVICE, HOST, OTHERS, SAVE, Watchdog, data_wait, injected_stall
from lm_train.tools.harness.during_training import harness_during_training
from lm_train.tools.hf_export import export_during_training


@dataclass
class TrainResult:
    """What a finished run leaves behind."""

    paths: RunPaths
    final_step: int
    state: TrainerState
    last_eval_loss: float | None
    exit_status: int = 0  # 128 + signal when a stop signal ended the run early (schedulers must not see success)


def train(
    config: TrainLmConfig, config_files: Sequence[Path] = (), kind: TrainingKind = LANGUAGE_MODELING
) -> TrainResult:
    """Run (or resume) training as the config says (`kind`: which kind of training); returns the final state."""
    setup = with_run_loss_blocks(prepare_run(config, initialize_distributed(), config_files))
    kind.check_batch_sizes(setup.config, setup.plan.data_size)
    check_trackers_ready(config.trainer.tracker, setup.dist.process_index)  # before Ray, data and compiles
    setup.paths.check_can_create()
    # Before Ray, data and the compile: a run that will not fit costs a trace, not a crash after the compile.
    guard = check_before_compile(setup, kind)
    enable_compilation_cache(config)  # before init_state, the run's first compile
    try:
        with ray_cluster(config.trainer.ray, setup.dist), RunConsole(enabled=setup.is_main):
            return _train(setup, setup.config, kind, guard)
    except jax.errors.JaxRuntimeError as error:
        out_of_memory = guard.out_of_memory(error)
        if out_of_memory is None:
            raise
        raise out_of_memory from None


def _train(setup: RunSetup, config: TrainLmConfig, kind: TrainingKind, guard: MemoryGuard) -> TrainResult:
    data = kind.prepare_data(setup)
    try:
        state, target = kind.start(setup, data)
        write_run_dir(setup, data)
        start = int(state.step)
        if start >= config.trainer.num_train_steps:  # a finished run, rerun: no table, no bar, no steps
            if setup.is_main:
                print(
                    f"run {setup.paths.run_dir} is already at step {start} of {config.trainer.num_train_steps}: "
                    "nothing to train. Raise trainer.num_train_steps to train on, or give a new trainer.id.",
                    file=sys.stderr,
                    flush=True,
                )
            return TrainResult(setup.paths, start, state, None)
        resumed = setup.resume_from is not None
        if setup.is_main:  # the whole config is in config.yaml (written above); `lm-train config show` prints it
            summary = run_summary(setup, data, state.model, start, kind.sequences_per_example)
            print(summary, file=sys.stderr, flush=True)
        with run_tracker(
            config.trainer.tracker,
            setup.paths,
            process_index=setup.dist.process_index,
            resume_from_step=start + 1 if resumed else None,
        ) as tracker:
            return _run_loop(setup, data, state, target, tracker, kind, guard)
    finally:
        # A build left running would outlive Ray's shutdown at exit, and its thread would start a new Ray.
        # Stopped, it keeps what it committed, and the next run resumes it.
        data.stop_builds()


def _checkpointer(setup: RunSetup) -> dist_ckpt.Checkpointer:
    checkpointing = setup.config.trainer.checkpointer
    return dist_ckpt.Checkpointer(
        checkpointing.base_path or setup.paths.checkpoints,
        save_interval=checkpointing.save_interval,
        keep=[{"every": k.every, "until": k.until} for k in checkpointing.keep],
        progress=setup.is_main,
        clock=checkpoint_clock(),
    )


def compiled_train_step(setup: RunSetup, target: TrainerState, kind: TrainingKind = LANGUAGE_MODELING) -> CompiledStep:
    """The run's train step as the loop runs it: watch and objective from the config, layouts from `target`."""
    t = setup.config.trainer
    watch = make_watch(t.watch)  # None when off: the step then has none
    step_fn = make_train_step(setup.optimizer, setup.step_settings, setup.schedule, watch, kind.objective(setup.config))
    return CompiledStep(step_fn, StateLayout(target), setup.plan, setup.config.model.Pos, t.batch_axis, kind.fields)


def _run_loop(
    setup: RunSetup,
    data: PreparedData,
    state: TrainerState,
    target: TrainerState,
    tracker: trackers.Tracker,
    kind: TrainingKind = LANGUAGE_MODELING,
    guard: MemoryGuard | None = None,
) -> TrainResult:
    """Step from the state's step to trainer.num_train_steps, or until a stop signal or the end of the data."""
    config, t = setup.config, setup.config.trainer
    Pos, total, start = config.model.Pos, t.num_train_steps, int(state.step)
    train_step = compiled_train_step(setup, target, kind)
    inputs = kind.inputs(setup, data)
    sizes = t.batch_schedule  # examples per step; a schedule's step compiles once per distinct size
    rows = inputs.rows or sizes.size_at
    checkpointer, stop, last_eval = _checkpointer(setup), StopRequest(setup.dist.process_count), None
    decisions = StepDecisions(stop, checkpointer)
    harness = harness_during_training(setup, tracker)  # None when trainer.eval_harness is off
    profiler = None
    exit_status = 0
    if setup.is_main:
        tracker.log_hyperparameters({"config": dump_config(config)})
    # A mixture that runs out (stop_strategy first_exhausted) ends the loop after its last complete step.
    prefetch = Prefetcher(inputs.batch, start, total, end_of_data=(shard_cache.MixtureExhaustedError,))
    step_delay = float(os.environ.get("LM_TRAIN_STEP_DELAY_S", "0"))  # fault-injection tests slow the loop
    stall_at = injected_stall()  # the watchdog's tests stop a process stepping after this step
    stopping, saved = False, True
    watchdog = Watchdog.for_run(
        t.watchdog.timeout_s, setup.paths.run_dir, (setup.dist.process_index, setup.dist.process_count)
    )
    try:
        with TrainingProgress(total, start, enabled=setup.is_main) as bar:
            if start < total:  # the prefetcher's thread reads the first batch meanwhile
                bar.say("compiling the train step ...")
                compile_step = lambda: train_step.precompile(state, rows(start), inputs.fields)  # noqa: E731
                compiled = timed_compile("train step", compile_step, report=setup.is_main)
                if guard is not None:
                    guard.check_compiled(compiled)  # XLA's own figure, before the first step allocates it
                bar.say("train")
            prefetch.on_wait = data_wait(watchdog, data.train_caches_finished, lambda: bar.say(_waiting_text(data)))
            logged = StepMetricsLogger(
                tracker,
                bar,
                tokens_per_step=sizes.size_at(start) * Pos.size * kind.sequences_per_example,
                flops_per_token=config.model.flops_per_token(data.vocab_size()) * kind.flops_scale,
                peak_flops=peak_flops_per_device() * len(setup.plan.mesh.devices.flat),
            )
            process = (setup.dist.process_index, setup.dist.process_count)
            profiler = StepProfiler.for_run(t.profiler, setup.paths.run_dir, process, tracker, bar.note)
            wait_for_every_process("first_step")  # the first step's collectives time out if a host is 30 s late
            host_times = HostStepTimes(*process)  # timed from here: the wait above is no host's own work
            previous = None  # the loss of the step dispatched before this one
            for step, local in prefetch:
                watchdog.beat(step + 1)
                if step > start and rows(step) != rows(step - 1):  # a new batch size: its step compiles now, once
                    watchdog.excuse()
                    bar.note(f"batch size {sizes.size_at(step)} from step {step + 1} (the schedule's start {step})")
                if inputs.rollout is not None:  # on-policy (RL): the batch is sampled from the current weights
                    local = inputs.rollout(step, local, state)
                if profiler:  # host-side only, and None when off: the step is the same either way
                    profiler.before_step(step)
                # Waits for the device or the other hosts are timed apart from this host's own work (they
                # include the dispatch: a CPU backend runs the step in it).
                waiting, watchdog.phase = time.perf_counter(), DEVICE
                state, metrics = train_step(state, local)
                host_times.waited(time.perf_counter() - waiting)
                watchdog.phase = HOST
                if profiler:
                    profiler.after_step(step, state)
                done = step + 1
                logged.step_done(sizes.size_at(step) * Pos.size * kind.sequences_per_example)
                host_times.step_done()
                bar.dispatched(done, metrics["train/loss"])  # advances once the step's loss is computed
                # One step queued behind the one running keeps the device busy; more would let a stop signal
                # run every step the host had dispatched ahead (up to the next log step's fetch).
                if previous is not None:
                    waiting, watchdog.phase = time.perf_counter(), DEVICE
                    previous.block_until_ready()
                    host_times.waited(time.perf_counter() - waiting)
                    watchdog.phase = HOST
                    bar.poll()
                previous = metrics["train/loss"]
                if done % t.log_every == 0 or done == total:
                    waiting, watchdog.phase = time.perf_counter(), DEVICE
                    previous.block_until_ready()  # the log's fetch waits for the step anyway: a wait, not host work
                    host_times.waited(time.perf_counter() - waiting)
                    watchdog.phase = OTHERS
                    extra = inputs.data_metrics(done) | preprocessing_metrics(data) | host_times.gather(done)
                    watchdog.phase = HOST
                    logged.log(done, metrics, extra=extra)
                if inputs.has_eval and (done % t.steps_per_eval == 0 or done == total):
                    watchdog.excuse()  # work beside the step (maybe process 0's alone): the next step has longer
                    last_eval = inputs.evaluate_and_log(state, tracker, done, last_eval, bar, t.model_averaging)
                if harness and (done % harness.every == 0 or done == total):
                    watchdog.excuse()
                    harness.run(state.model, done, bar.note)
                if done == total or (config.hf_save_steps and done % config.hf_save_steps == 0):
                    watchdog.excuse()
                    exported = export_during_training(
                        config, setup.paths, exported_model(state, t.model_averaging), done
                    )
                    bar.note(f"exported to {exported}")
                waiting, watchdog.phase = time.perf_counter(), DECISION
                stopping, decision = decisions.after(done, last=done == total)
                watchdog.phase = SAVE  # its barrier waits for every host: the same work on each, not a straggler's
                saved = checkpointer.on_agreed_step(checkpointed(state.checkpointed()), done, decision)
                host_times.waited(time.perf_counter() - waiting)
                watchdog.phase = HOST
                if saved:
                    watchdog.excuse()
                data.check_builds()
                if stopping:
                    checkpointer.wait()
                    exit_status = stop.exit_status()
                    bar.note(
                        f"stopped by a signal at step {done}; the checkpoint is saved under {checkpointer.root}: "
                        "rerun the same command to resume."
                    )
                    break
                if step_delay:
                    time.sleep(step_delay)
                if done == stall_at:
                    time.sleep(24 * 3600)
            watchdog.close()  # what follows the last step is no step
            if prefetch.ended_by is not None:
                if not saved:
                    checkpointer.on_step(checkpointed(state.checkpointed()), int(state.step), force=True)
                bar.note(f"training ends at step {int(state.step)}: {prefetch.ended_by}")
        checkpointer.wait()
        if setup.is_main and last_eval is not None:
            tracker.log_summary({"eval/loss": last_eval})
        summary = inputs.summary() if setup.is_main else None
        if summary is not None:
            tracker.log_summary(summary.metrics)
            print(summary.text, file=sys.stderr, flush=True)
    except (dist_ckpt.BackgroundSaveError, dist_ckpt.StorageError) as error:  # only the checkpointer raises these
        raise save_failed(error, checkpointer.root, int(state.step)) from error
    finally:
        watchdog.close()
        if profiler:
            profiler.close()
        stop.restore()
        prefetch.close()
    return TrainResult(setup.paths, int(state.step), state, last_eval, exit_status)


def preprocessing_metrics(data: PreparedData) -> dict[str, float]:
    """The cache builds' counts since the last log, read on the host (the step never waits for them)."""
    return data.build_metrics.new_values() if data.build_metrics is not None else {}


def _waiting_text(data: PreparedData) -> str:
    percent = data.build_metrics.percent() if data.build_metrics is not None else None
    return "waiting for data ..." if percent is None else f"waiting for data (cache at {percent:.0f}%) ..."


__all__ = ["TrainResult", "compiled_train_step", "train"]
