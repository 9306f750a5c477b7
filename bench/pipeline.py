"""Pipeline parallelism on 8 CPU devices: tokens/s of pipeline 2 x data 4 against data 8, same model and batch, and
the bubble measured from the step times against the schedule's formula.

On one host the 8 devices share the CPU's cores, so a stage never idles in the bubble: it computes on nothing (the
schedule runs every stage at every tick, as it must on real devices to stay one program). The bubble then shows as
extra compute, and 1 - (data 8's step time / the pipeline's) measures it together with the collectives' cost on
one host, against (stages - 1) / (microbatches + stages - 1).

Prints one JSON line. Run: `uv run python bench/pipeline.py` (about 1-2 minutes on 2 cores).
"""

from __future__ import annotations

import os

# Before jax starts: the CPU shows itself as 8 devices.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse

import jax
import numpy as np
from common import REPO_ROOT, best_of, emit, log

import named_tensors as nt


def compiled_layout(overrides: list[str], vocab: int):
    """(compiled step, fresh state, its schedule or None) of configs/llama_nano.yaml with `overrides`."""
    from lm_train.config import load_train_config
    from lm_train.optim import build_optimizer
    from lm_train.run.compiled import CompiledStep, StateLayout
    from lm_train.run.mesh import plan_mesh
    from lm_train.run.pipeline_checks import check_pipeline
    from lm_train.run.state import init_state, state_shapes
    from lm_train.run.step import StepSettings, make_train_step

    config, _ = load_train_config([REPO_ROOT / "configs" / "llama_nano.yaml"], overrides)
    plan = plan_mesh(config.trainer)
    check_pipeline(config, plan, 1)
    Vocab = nt.Axis("vocab", vocab)
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    settings = StepSettings.of_config(config, 1)
    target = state_shapes(config, plan, Vocab, optimizer)
    step = CompiledStep(
        make_train_step(optimizer, settings, schedule), StateLayout(target), plan, config.model.Pos, "batch"
    )
    return step, init_state(config, plan, Vocab, optimizer), settings.pipeline


def step_seconds(step, state, batch: np.ndarray, rounds: int) -> float:
    """The fastest of `rounds` steps after a first one that compiles."""
    holder = {"state": step(state, batch)[0]}

    def one() -> None:
        holder["state"], metrics = step(holder["state"], batch)
        jax.block_until_ready(metrics["train/loss"])

    return best_of(rounds, one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    vocab = 256
    shape = ["--model.seq_len", str(args.seq), "--model.hidden_dim", str(args.hidden), "--model.num_layers"]
    shape += [str(args.layers), "--model.intermediate_dim", str(args.hidden * 3), "--trainer.train_batch_size"]
    shape += [str(args.batch), "--trainer.mp", "f32"]
    batch = np.random.default_rng(0).integers(0, vocab, size=(args.batch, args.seq)).astype(np.int32)
    tokens = args.batch * args.seq

    log("data 8 ...")
    data_step, data_state, _ = compiled_layout(shape, vocab)
    data_s = step_seconds(data_step, data_state, batch, args.rounds)
    log("pipeline 2 x data 4 ...")
    pipe = ["--trainer.pipeline_axis_size", "2", "--trainer.pipeline.microbatches", str(args.microbatches)]
    pipe_step, pipe_state, schedule = compiled_layout(shape + pipe, vocab)
    pipe_s = step_seconds(pipe_step, pipe_state, batch, args.rounds)
    assert schedule is not None
    emit(
        "pipeline.stage2_data4",
        {
            "pipeline_tokens_per_s": round(tokens / pipe_s, 1),
            "data8_tokens_per_s": round(tokens / data_s, 1),
            "pipeline_step_s": round(pipe_s, 4),
            "data8_step_s": round(data_s, 4),
            "stages": schedule.stages,
            "microbatches": schedule.microbatches,
            "bubble_formula": round(schedule.bubble(), 4),
            "bubble_measured": round(1 - data_s / pipe_s, 4),
            "shape": {"batch": args.batch, "seq": args.seq, "hidden": args.hidden, "layers": args.layers},
        },
        reference="data 8 (data parallel + FSDP over the same 8 CPU devices), same model, batch and step",
        ratio=data_s / pipe_s,
        ratio_means=(
            "pipeline 2 x data 4 tokens/s / data 8 tokens/s on one host's CPU devices: the bubble's wasted compute "
            "and the collectives' cost on one host (bubble_measured = 1 - ratio, against bubble_formula)"
        ),
    )


if __name__ == "__main__":
    main()
