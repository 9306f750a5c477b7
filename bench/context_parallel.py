"""Tokens/s of a train step under context 4 x data 2 against data 8, for the same nano model on 8 CPU devices.

    uv run python bench/context_parallel.py [--seq 512] [--batch 8] [--steps 5] [--rounds 3]

Both layouts run the step `lm-train run` compiles (the same config, optimizer and batches), alternating round by
round so that a noisy neighbour slows both. On one host the 8 "devices" share the CPU's cores and memory, so the
ratio records what the ring costs here (its collective permutes, the load-balancing reorder, per-block work) and
not what it saves on accelerators, where the sequence would otherwise not fit: it says so in its line.
"""

from __future__ import annotations

import os

# Before jax is imported (common's helpers import it lazily): the CPU as 8 devices.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import dataclasses
from pathlib import Path

import jax
import numpy as np
from common import REPO_ROOT, emit, log, median, time_call

import named_tensors as nt

CONTEXT = 4
VOCAB = nt.Axis("vocab", 512)


def compiled_layout(config, optimizer, schedule, **trainer):
    """(step, state) for the config with these trainer keys, on all 8 devices."""
    from lm_train.run.compiled import CompiledStep, StateLayout
    from lm_train.run.mesh import plan_mesh
    from lm_train.run.precision import parse_policy
    from lm_train.run.state import init_state, state_shapes
    from lm_train.run.step import StepSettings, make_train_step

    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, **trainer))
    plan = plan_mesh(config.trainer)
    settings = StepSettings.of_config(config, 1, parse_policy("f32"))
    target = state_shapes(config, plan, VOCAB, optimizer)
    step = CompiledStep(
        make_train_step(optimizer, settings, schedule), StateLayout(target), plan, config.model.Pos, "batch"
    )
    return step, init_state(config, plan, VOCAB, optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=512, help="positions per sequence (a multiple of 8)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (a multiple of 8)")
    parser.add_argument("--hidden", type=int, default=128, help="model.hidden_dim")
    parser.add_argument("--layers", type=int, default=2, help="model.num_layers")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating the layouts")
    args = parser.parse_args()

    from lm_train.config import load_train_config
    from lm_train.optim import build_optimizer

    overrides = ["--trainer.mp", "f32", "--trainer.train_batch_size", str(args.batch)]
    overrides += ["--model.seq_len", str(args.seq), "--model.hidden_dim", str(args.hidden)]
    overrides += ["--model.num_layers", str(args.layers), "--model.num_heads", "4"]
    config, _ = load_train_config([Path(REPO_ROOT) / "configs" / "gpt2_nano.yaml"], overrides)
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    layouts = {
        "data8": compiled_layout(config, optimizer, schedule),
        "context4_data2": compiled_layout(config, optimizer, schedule, context_axis_size=CONTEXT),
    }
    rng = np.random.default_rng(0)
    batch = rng.integers(0, VOCAB.size, (args.batch, args.seq)).astype(np.int32)
    states = {}
    for name, (step, state) in layouts.items():
        compile_s, (state, _) = time_call(lambda step=step, state=state: jax.block_until_ready(step(state, batch)))
        log(f"{name}: first step (compile) {compile_s:.1f} s")
        states[name] = state
    seconds: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name, (step, _) in layouts.items():
            state = states[name]
            elapsed = 0.0
            for _ in range(args.steps):
                took, (state, _) = time_call(lambda step=step, state=state: jax.block_until_ready(step(state, batch)))
                elapsed += took
            states[name] = state
            seconds[name].append(elapsed / args.steps)
    tokens = args.batch * args.seq
    per_s = {name: tokens / median(times) for name, times in seconds.items()}
    emit(
        "context_parallel.nano",
        {
            "context4_data2_tokens_per_s": round(per_s["context4_data2"], 1),
            "seq": args.seq,
            "batch": args.batch,
            "note": "8 CPU devices on one host: the ratio is the ring's cost in collectives here, not its memory gain",
        },
        reference={"data8_tokens_per_s": round(per_s["data8"], 1)},
        ratio=per_s["context4_data2"] / per_s["data8"],
        ratio_means="context 4 x data 2 tokens/s / data 8 tokens/s, same model and batches, 8 CPU devices of one host; "
        "median of rounds",
    )


if __name__ == "__main__":
    main()
