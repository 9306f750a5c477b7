"""Expert parallelism's cost on one host: tokens/s of Mixtral nano at expert 4 x data 2 against data 8, on 8 CPU
devices, as one JSON line `expert_parallel.mixtral_nano` (ratio: expert-parallel tokens/s over data-parallel).

Both layouts run the same model, batch and step (lm-train's CompiledStep), compiled before timing, in alternating
rounds so that a noisy neighbour slows both alike. The 8 "devices" are threads of one CPU: the figure records the
cost of the all-to-all dispatch (packing, two exchanges, buffers sized for every local token) against data
parallelism's replicated experts on one host, not the gain of holding fewer experts per device that expert
parallelism buys on accelerators with their own memory.

    uv run python bench/expert_parallel.py [--hidden 128 --layers 4 --seq 128 --batch 16 --steps 3 --rounds 5]
"""

from __future__ import annotations

import os

# Before jax initialises: the CPU as 8 devices.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import time

import jax
import numpy as np
from common import REPO_ROOT, emit, log, median

import named_tensors as nt
from lm_train.config import load_train_config
from lm_train.optim import build_optimizer
from lm_train.run.compiled import CompiledStep, StateLayout
from lm_train.run.mesh import plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_state, state_shapes
from lm_train.run.step import StepSettings, make_train_step

Vocab = nt.Axis("vocab", 4096)


def layout(args: argparse.Namespace, expert_axis_size: int):
    """The compiled step and a fresh state of Mixtral nano on all 8 devices with this expert axis."""
    overrides = ["--model.hidden_dim", str(args.hidden), "--model.num_layers", str(args.layers)]
    overrides += ["--model.seq_len", str(args.seq), "--trainer.train_batch_size", str(args.batch)]
    overrides += ["--trainer.expert_axis_size", str(expert_axis_size)]
    config, _ = load_train_config([REPO_ROOT / "configs" / "mixtral_nano.yaml"], overrides)
    plan = plan_mesh(config.trainer)
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    settings = StepSettings(parse_policy(config.trainer.mp), 1, 0.0)
    shapes = state_shapes(config, plan, Vocab, optimizer)
    step = CompiledStep(
        make_train_step(optimizer, settings, schedule), StateLayout(shapes), plan, config.model.Pos, "batch"
    )
    state = init_state(config, plan, Vocab, optimizer)
    step.precompile(state, args.batch)
    return step, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    batch = np.random.default_rng(0).integers(0, Vocab.size, size=(args.batch, args.seq), dtype=np.int32)
    runs = {"expert_4_x_data_2": layout(args, 4), "data_8": layout(args, 1)}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for name, (step, state) in runs.items():  # a warm-up step each, outside the timing
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        runs[name] = (step, state)
    for r in range(args.rounds):
        for name, (step, state) in runs.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            seconds[name].append(time.perf_counter() - start)
            runs[name] = (step, state)
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {s[-1]:.3f} s" for n, s in seconds.items()))
    tokens = args.steps * args.batch * args.seq
    rates = {name: tokens / median(s) for name, s in seconds.items()}
    emit(
        "expert_parallel.mixtral_nano",
        {
            "expert_tokens_per_s": round(rates["expert_4_x_data_2"], 1),
            "data_tokens_per_s": round(rates["data_8"], 1),
            "layouts": "expert 4 x data 2 vs data 8, 8 CPU devices of one host",
            "shape": {"hidden": args.hidden, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        },
        reference="data 8 tokens/s, same model and batch, same run",
        ratio=rates["expert_4_x_data_2"] / rates["data_8"],
        ratio_means="expert 4 x data 2 tokens/s / data 8 tokens/s (median rounds); on one host's CPU threads it is the "
        "cost of the all-to-all dispatch, not the memory that holding 1/4 of the experts saves on accelerators",
    )


if __name__ == "__main__":
    main()
