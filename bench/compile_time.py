"""Compile time of a train-step gradient vs number of layers: Stacked (scan) against BlockSeq (unrolled).

Prints one JSON line. Run: `uv run python bench/compile_time.py` (about 1-3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from common import emit

import named_tensors as nt
from named_tensors import Axis, NamedArray

Batch = Axis("batch", 4)
Pos = Axis("position", 16)
Embed = Axis("embed", 64)
Mlp = Axis("mlp", 256)


class Block(eqx.Module):
    """A transformer-ish block: RMS-style norm, then up and down projections, with a residual."""

    norm_scale: NamedArray
    w_up: NamedArray
    w_down: NamedArray

    def __call__(self, x: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        normed = x * nt.rsqrt(nt.mean(nt.square(x), Embed) + 1e-6) * self.norm_scale
        hidden = nt.gelu(nt.dot(normed, self.w_up, axis=Embed))
        return x + nt.dot(hidden, self.w_down, axis=Mlp)


def make_block(key: jax.Array) -> Block:
    k_up, k_down = jax.random.split(key)
    return Block(
        nt.ones(Embed),
        nt.random.normal(k_up, (Embed, Mlp)) * 0.02,
        nt.random.normal(k_down, (Mlp, Embed)) * 0.02,
    )


def compile_seconds(model: eqx.Module, x: NamedArray) -> tuple[float, float]:
    """(CPU seconds, wall seconds) to trace, lower and compile the gradient of a scalar loss through `model`."""
    params, static = eqx.partition(model, eqx.is_array)

    def loss(params: eqx.Module, x: NamedArray) -> jax.Array:
        return nt.mean(nt.square(eqx.combine(params, static)(x))).scalar()

    step = jax.jit(jax.value_and_grad(loss))
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    step.lower(params, x).compile()
    return time.process_time() - cpu_start, time.perf_counter() - wall_start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 24, 48])
    parser.add_argument("--repeats", type=int, default=2, help="compile each model this many times; keep the min")
    args = parser.parse_args()
    x = nt.random.normal(jax.random.key(0), (Batch, Pos, Embed))
    compile_seconds(nt.Stacked.init(Axis("layers", 1), make_block, key=jax.random.key(1)), x)  # warm up jax
    # CPU time of this process is the main figure: on a shared machine, wall time mostly measures the
    # neighbours. Both are the minimum over repeats, since noise only ever adds time.
    stacked, unrolled, stacked_wall, unrolled_wall = [], [], [], []
    for n in args.layers:
        stack = nt.Stacked.init(Axis("layers", n), make_block, key=jax.random.key(1))
        for model, cpu_list, wall_list in ((stack, stacked, stacked_wall), (stack.unstack(), unrolled, unrolled_wall)):
            runs = [compile_seconds(model, x) for _ in range(args.repeats)]
            cpu_list.append(round(min(r[0] for r in runs), 3))
            wall_list.append(round(min(r[1] for r in runs), 3))
    last = args.layers[-1]
    emit(
        "named_tensors.compile_time",
        {
            "what": "CPU seconds to trace and compile value_and_grad of a loss through N blocks (min of repeats)",
            "repeats": args.repeats,
            "layers": args.layers,
            "stacked_scan_s": stacked,
            "blockseq_unrolled_s": unrolled,
            "stacked_scan_wall_s": stacked_wall,
            "blockseq_unrolled_wall_s": unrolled_wall,
            f"stacked_growth_{args.layers[0]}_to_{last}": round(stacked[-1] / stacked[0], 2),
            f"blockseq_growth_{args.layers[0]}_to_{last}": round(unrolled[-1] / unrolled[0], 2),
            "block": f"norm + dot + gelu + dot over {Batch}, {Pos}, {Embed}, {Mlp}",
            "dtype": str(jnp.float32.dtype),
        },
        reference={f"blockseq_unrolled_s_at_{last}": unrolled[-1]},
        ratio=unrolled[-1] / stacked[-1],
        ratio_means=f"BlockSeq (unrolled) compile CPU-s / Stacked (scan) compile CPU-s at {last} layers; > 1: scan "
        "compiles faster",
    )


if __name__ == "__main__":
    main()
