"""The training loop: build or resume the state, step with prefetched data, log, evaluate, checkpoint."""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import dist_ckpt
import named_tensors as nt
import trackers
from lm_train.compiled import CompiledStep, StateLayout
from lm_train.config.loading import dump_config
from lm_train.config.schema import TrainLmConfig
from lm_train.data.pipeline import (
    Prefetcher,
    PreparedData,
    TrainBatches,
    prepare_data,
    tokenizer_json,
    validation_batches,
)
from lm_train.distributed import DistributedInfo, initialize_distributed
from lm_train.errors import CheckpointError
from lm_train.flops import peak_flops_per_device
from lm_train.mesh import MeshPlan, check_batch_fits, plan_mesh
from lm_train.optim import build_optimizer
from lm_train.precision import LossScale, needs_loss_scaling, parse_policy
from lm_train.progress import TrainingProgress
from lm_train.run_dir import RunPaths
from lm_train.step import StepSettings, TrainerState, make_eval_step, make_train_step, trainable

logger = logging.getLogger(__name__)

PURPOSE_INIT = 0


@dataclass
class TrainResult:
    """What a finished run leaves behind."""

    paths: RunPaths
    final_step: int
    state: TrainerState
    last_eval_loss: float | None


def _vocab_axis(data: PreparedData) -> nt.Axis:
    return nt.Axis("vocab", data.vocab_size())


def _state_factory(config: TrainLmConfig, Vocab: nt.Axis, optimizer: Any):
    policy = parse_policy(config.trainer.mp)
    base_key = jax.random.key(config.trainer.seed)
    model_key = jax.random.fold_in(base_key, PURPOSE_INIT)

    def make() -> TrainerState:
        model = config.model.build(Vocab, key=model_key)
        model = policy.cast_to_param(model)
        with jax.numpy_dtype_promotion("standard"):
            opt_state = optimizer.init(trainable(model))
        return TrainerState(
            step=jnp.zeros((), jnp.int32),
            model=model,
            opt_state=opt_state,
            key=jax.random.key_data(base_key),
            loss_scale=LossScale.create(needs_loss_scaling(policy)),
        )

    return make


def state_shapes(config: TrainLmConfig, plan: MeshPlan, Vocab: nt.Axis, optimizer: Any) -> TrainerState:
    """The state's structure as ShapeDtypeStructs carrying their shardings: a target to load onto."""
    shapes = eqx.filter_eval_shape(_state_factory(config, Vocab, optimizer))
    shardings = nt.infer_sharding(shapes, plan.param_mapping, plan.mesh)
    return jax.tree_util.tree_map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes, shardings
    )


def init_state(config: TrainLmConfig, plan: MeshPlan, Vocab: nt.Axis, optimizer: Any) -> TrainerState:
    """A fresh state, created directly in its sharded layout (no full copy on one device)."""
    layout = StateLayout(state_shapes(config, plan, Vocab, optimizer))
    make = _state_factory(config, Vocab, optimizer)
    arrays = jax.jit(lambda: layout.arrays(make()), out_shardings=layout.shardings)()
    return layout.state(arrays)


def restore_state(path: Path, target: TrainerState) -> TrainerState:
    """Load a checkpoint onto the state's sharded layout; a structure or shape mismatch is a clear error."""
    try:
        return dist_ckpt.load(path, target)
    except dist_ckpt.TreeMismatchError as e:
        raise CheckpointError(
            f"Checkpoint {path} does not fit this config's model: {e} Resume with the config that wrote it, or "
            "start a new run (another trainer.id or trainer.run_dir, or trainer.load_checkpoint: false)."
        ) from None


def _initialize_from_hf(state: TrainerState, path: str, plan: MeshPlan, target: Any, is_main: bool) -> TrainerState:
    """Replace a fresh state's parameters with a Hugging Face checkpoint's (continued pretraining)."""
    import hf_bridge

    model = hf_bridge.load_weights(path, state.model, mesh=plan.mesh, axis_mapping=plan.param_mapping)
    model = jax.device_put(model, jax.tree_util.tree_map(lambda s: s.sharding, target.model))
    if is_main:
        print(f"initialized the model from {path}", file=sys.stderr, flush=True)
    return eqx.tree_at(lambda s: s.model, state, model)


def _export_hf(config: TrainLmConfig, paths: RunPaths, state: TrainerState, step: int) -> Path:
    from lm_train.export import export_model

    out = Path(config.hf_save_path) if config.hf_save_path else paths.hf
    out = out / f"step-{step}"
    export_model(state.model, config.model, paths.tokenizer_file, out, overwrite=True)
    return out


def _find_checkpoint(config: TrainLmConfig, paths: RunPaths) -> Path | None:
    trainer = config.trainer
    if trainer.load_checkpoint_path:
        path = Path(trainer.load_checkpoint_path)
        found = dist_ckpt.latest(path) or (path if (path / "manifest.json").exists() else None)
        if found is None:
            raise CheckpointError(
                f"trainer.load_checkpoint_path: no complete checkpoint at {path}. Point it at a checkpoint "
                "directory (…/checkpoints/step-N) or at a folder of them."
            )
        return found
    if trainer.load_checkpoint is False:
        return None
    found = dist_ckpt.latest(paths.checkpoints)
    if found is None and trainer.load_checkpoint:
        raise CheckpointError(
            f"trainer.load_checkpoint is true but {paths.checkpoints} holds no complete checkpoint. Remove the "
            "flag to start fresh."
        )
    return found


def evaluate(model: Any, eval_step: Any, batches: Any, plan: MeshPlan, Pos: nt.Axis, batch_axis: str) -> float | None:
    """Mean next-token loss over the validation batches (None if there are none)."""
    total, count = 0.0, 0.0
    for local in batches:
        ids = _device_batch(local, plan, Pos, batch_axis)
        s, c = eval_step(model, ids)
        total += float(s)
        count += float(c)
    return total / count if count else None


def _device_batch(local: np.ndarray, plan: MeshPlan, Pos: nt.Axis, batch_axis: str) -> nt.NamedArray:
    array = jax.make_array_from_process_local_data(plan.batch_sharding(), np.asarray(local, np.int32))
    return nt.NamedArray(array, (nt.Axis(batch_axis, array.shape[0]), Pos))


class StopRequest:
    """SIGTERM/SIGINT ask the loop to checkpoint and stop after the current step (preemption)."""

    def __init__(self, process_count: int):
        self.flag = False
        self.process_count = process_count
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.flag and signum == signal.SIGINT:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        self.flag = True

    def requested(self, check_all: bool) -> bool:
        """Whether to stop now; with several processes they agree (at log steps), so all save together."""
        if self.process_count == 1:
            return self.flag
        if not check_all:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(self.flag))
        return bool(np.any(flags))

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(config: TrainLmConfig, config_files: Sequence[Path] = ()) -> TrainResult:
    """Run (or resume) training as the config says; returns the final state."""
    dist = initialize_distributed()
    paths = RunPaths.for_config(config, config_files)
    trainer_cfg = config.trainer
    plan = plan_mesh(trainer_cfg)
    microbatches = check_batch_fits(trainer_cfg, plan, dist.process_count)
    is_main = dist.process_index == 0
    data = prepare_data(config.data, background=True, progress=is_main, builder=is_main)
    try:
        return _train_on(config, data, dist, paths, plan, microbatches)
    finally:
        # A build left running would outlive Ray's shutdown at exit, and its thread would start a new Ray.
        # Stopped, it keeps what it committed, and the next run resumes it.
        data.stop_builds()


def _train_on(
    config: TrainLmConfig,
    data: PreparedData,
    dist: DistributedInfo,
    paths: RunPaths,
    plan: MeshPlan,
    microbatches: int,
) -> TrainResult:
    """The body of `train`, once the data is prepared (its builds may still be running)."""
    trainer_cfg = config.trainer
    policy = parse_policy(trainer_cfg.mp)
    is_main = dist.process_index == 0
    Vocab = _vocab_axis(data)
    Pos = config.model.Pos
    optimizer, schedule = build_optimizer(config.optimizer, trainer_cfg.num_train_steps)
    target = state_shapes(config, plan, Vocab, optimizer)
    checkpoint = _find_checkpoint(config, paths)
    if checkpoint is not None:
        state = restore_state(checkpoint, target)
        if is_main:
            print(f"resuming from {checkpoint}", file=sys.stderr, flush=True)
    else:
        state = init_state(config, plan, Vocab, optimizer)
        if config.initialize_from_hf:
            state = _initialize_from_hf(state, config.initialize_from_hf, plan, target, is_main)
    if is_main:
        # Written only once the checkpoint (if any) fits: a bad rerun leaves the run directory as it was. The run
        # directory is then self-contained for eval, sample and export.
        paths.create()
        paths.config_file.write_text(dump_config(config), encoding="utf-8")
        shutil.copyfile(tokenizer_json(data.tokenizer_path), paths.tokenizer_file)
    start_step = int(state.step)
    if start_step >= trainer_cfg.num_train_steps and is_main:
        logger.warning("run %s is already at step %d of %d", paths.run_dir, start_step, trainer_cfg.num_train_steps)

    tracker_configs = list(trackers.tracker_configs_from_value(trainer_cfg.tracker, "trainer.tracker"))
    if not any(isinstance(c, trackers.JsonlConfig) for c in tracker_configs):
        tracker_configs.insert(0, trackers.JsonlConfig(path=paths.metrics_file.name))
    tracker = trackers.build_tracker(
        tracker_configs,
        paths.run_dir,
        process_index=dist.process_index,
        resume_from_step=start_step + 1 if checkpoint is not None else None,
    )
    checkpointer = dist_ckpt.Checkpointer(
        trainer_cfg.checkpointer.base_path or paths.checkpoints,
        save_interval=trainer_cfg.checkpointer.save_interval,
        keep=[{"every": k.every, "until": k.until} for k in trainer_cfg.checkpointer.keep],
        progress=is_main,
    )

    settings = StepSettings(
        policy,
        microbatches,
        config.z_loss_weight,
        trainer_cfg.batch_axis,
        hessian_estimator=getattr(config.optimizer, "estimator", None),
    )
    step_fn = make_train_step(optimizer, settings, schedule)
    eval_fn = make_eval_step(policy)
    train_step = CompiledStep(step_fn, StateLayout(target), plan, Pos, trainer_cfg.batch_axis)
    eval_step = eqx.filter_jit(eval_fn)

    batches = TrainBatches(
        data,
        Pos.size,
        trainer_cfg.train_batch_size,
        trainer_cfg.seed,
        config.data.shuffle,
        dist.process_index,
        dist.process_count,
    )
    eval_batch = trainer_cfg.train_batch_size
    flops_per_token = config.model.flops_per_token(Vocab.size)
    peak = peak_flops_per_device() * len(plan.mesh.devices.flat)
    tokens_per_step = trainer_cfg.train_batch_size * Pos.size
    last_eval: float | None = None

    def run_eval(step: int) -> None:
        nonlocal last_eval
        with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
            loss = evaluate(
                state.model,
                eval_step,
                validation_batches(
                    data, Pos.size, eval_batch, trainer_cfg.max_eval_batches, dist.process_index, dist.process_count
                ),
                plan,
                Pos,
                trainer_cfg.batch_axis,
            )
        if loss is not None:
            last_eval = loss
            tracker.log({"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}, step=step)

    if is_main:
        tracker.log_hyperparameters({"config": dump_config(config)})
    prefetch = Prefetcher(batches.batch, start_step, trainer_cfg.num_train_steps)
    stop = StopRequest(dist.process_count)
    step_delay = float(os.environ.get("LM_TRAIN_STEP_DELAY_S", "0"))  # fault-injection tests slow the loop
    try:
        if start_step < trainer_cfg.num_train_steps:
            # The prefetcher's thread is reading the first batch meanwhile (the shuffle buffer's first era).
            train_step.precompile(state, trainer_cfg.train_batch_size)
        with TrainingProgress(trainer_cfg.num_train_steps, start_step, enabled=is_main) as bar:
            window_start, window_steps = time.perf_counter(), 0
            for step, local in prefetch:
                state, metrics = train_step(state, local)
                done = step + 1
                window_steps += 1
                bar.advance(done)
                if done % trainer_cfg.log_every == 0 or done == trainer_cfg.num_train_steps:
                    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    elapsed = time.perf_counter() - window_start
                    tps = window_steps * tokens_per_step / max(elapsed, 1e-9)
                    values["throughput/tokens_per_second"] = tps
                    values["throughput/mfu"] = tps * flops_per_token / peak
                    tracker.log(values, step=done)
                    bar.metrics(done, values["train/loss"], tps, values["throughput/mfu"], elapsed / window_steps)
                    window_start, window_steps = time.perf_counter(), 0
                if done % trainer_cfg.steps_per_eval == 0 or done == trainer_cfg.num_train_steps:
                    run_eval(done)
                if done == trainer_cfg.num_train_steps or (config.hf_save_steps and done % config.hf_save_steps == 0):
                    exported = _export_hf(config, paths, state, done)
                    bar.note(f"exported to {exported}")
                stopping = stop.requested(check_all=done % trainer_cfg.log_every == 0)
                checkpointer.on_step(state, done, force=done == trainer_cfg.num_train_steps or stopping)
                data.check_builds()
                if stopping:
                    checkpointer.wait()
                    bar.note(
                        f"stopped by a signal at step {done}; checkpoint saved under {checkpointer.root}. "
                        "Rerun the same command to resume."
                    )
                    print(f"stopped at step {done}: rerun the same command to resume", file=sys.stderr, flush=True)
                    break
                if step_delay:
                    time.sleep(step_delay)
        checkpointer.wait()
        if is_main and last_eval is not None:
            tracker.log_summary({"eval/loss": last_eval})
    finally:
        stop.restore()
        prefetch.close()
        tracker.finish()
    return TrainResult(paths, int(state.step), state, last_eval)


__all__ = ["TrainResult", "evaluate", "init_state", "restore_state", "state_shapes", "train"]
