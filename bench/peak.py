"""Peak matmul FLOP/s of this machine (jitted f32 and bf16, several sizes, best of N): the MFU denominator.

Prints one JSON line. Run: `uv run python bench/peak.py` (well under a minute on 2 cores).

On CPU the reference is what the trainer divides by (`lm_train.run.chips.peak_flops_per_device()`, a 512³ f32
matmul, summed over forced host devices), and the ratio is our best f32 measurement over it: near 1 means the
trainer's MFU denominator is the machine's real peak. On an accelerator the reference is the data-sheet dense
bf16 peak (`lm_train.run.chips`' table) and the ratio is the measured bf16 peak over it.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from common import emit, log

from lm_train.run import chips as lm_chips

CPU_PEAK_SIZES = (256, 512, 1024, 2048)


class MatmulProbe:
    """A compiled chain of `chain` back-to-back size³ matmuls, timed on demand: the matmul rate right now."""

    def __init__(self, size: int, dtype: jnp.dtype, chain: int = 1) -> None:
        key_a, key_b = jax.random.split(jax.random.key(0))
        self.a = jax.random.normal(key_a, (size, size), jnp.float32).astype(dtype)
        self.b = (jax.random.normal(key_b, (size, size), jnp.float32) / size**0.5).astype(dtype)
        self.flops = 2 * size**3 * chain

        @jax.jit
        def many(a: jax.Array, b: jax.Array) -> jax.Array:
            # A loop of dependent matmuls inside one program: dispatch overhead is paid once, and XLA cannot
            # drop or merge the products.
            return jax.lax.fori_loop(0, chain, lambda _, x: x @ b, a)

        self.many = many
        many(self.a, self.b).block_until_ready()

    def rate(self, repeats: int, budget_s: float = 0.0) -> float:
        """FLOP/s of the best of at least `repeats` timings, and more until `budget_s` seconds are spent."""
        best, count, began = float("inf"), 0, time.perf_counter()
        while count < repeats or time.perf_counter() - began < budget_s:
            start = time.perf_counter()
            self.many(self.a, self.b).block_until_ready()
            best = min(best, time.perf_counter() - start)
            count += 1
        return self.flops / best


def matmul_flops(size: int, dtype: jnp.dtype, repeats: int, chain: int, budget_s: float) -> float:
    """FLOP/s of the best timing of `chain` back-to-back jitted size³ matmuls: at least `repeats` timings, and
    more until `budget_s` seconds are spent (on a loaded machine, long runs rarely go uninterrupted)."""
    return MatmulProbe(size, dtype, chain).rate(repeats, budget_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_cpu = jax.default_backend() == "cpu"
    sizes = list(CPU_PEAK_SIZES) if on_cpu else [2048, 4096, 8192]
    parser.add_argument("--sizes", type=int, nargs="+", default=sizes)
    parser.add_argument("--repeats", type=int, default=5, help="at least this many timings per size and dtype")
    parser.add_argument("--chain", type=int, default=1 if on_cpu else 20, help="matmuls per timed program")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timing per size and dtype")
    args = parser.parse_args()

    figures: dict[str, float] = {}
    best: dict[str, float] = {}
    for name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        for size in args.sizes:
            rate = matmul_flops(size, dtype, args.repeats, args.chain, args.budget)
            figures[f"{name}_{size}_gflops"] = round(rate / 1e9, 1)
            best[name] = max(best.get(name, 0.0), rate)
            log(f"peak: {name} {size}³: {rate / 1e9:.1f} GFLOP/s")
        figures[f"{name}_best_gflops"] = round(best[name] / 1e9, 1)

    device = jax.devices()[0]
    if device.platform == "cpu":
        # The trainer's denominator, for the whole machine (it divides the measured peak by the forced devices).
        trainer_peak = lm_chips.peak_flops_per_device(device) * jax.local_device_count()
        reference = {"trainer_mfu_denominator_gflops": round(trainer_peak / 1e9, 1)}
        ratio = best["f32"] / trainer_peak
        ratio_means = "best measured f32 / the trainer's MFU denominator (lm_train.run.chips, 512³ f32 matmul)"
    else:
        chip = lm_chips.chip_for_kind(getattr(device, "device_kind", ""))
        sheet = None if chip is None else chip.bf16_flops
        reference = {"datasheet_bf16_tflops": None if sheet is None else round(sheet / 1e12, 1)}
        ratio = None if sheet is None else best["bf16"] / sheet
        ratio_means = "best measured bf16 / the chip's data-sheet dense bf16 peak"
    emit(
        "peak",
        {
            **figures,
            "peak_f32_gflops": round(best["f32"] / 1e9, 1),
            "peak_bf16_gflops": round(best["bf16"] / 1e9, 1),
            "sizes": args.sizes,
            "repeats": args.repeats,
            "budget_s": args.budget,
            "chain": args.chain,
        },
        reference=reference,
        ratio=ratio,
        ratio_means=ratio_means,
    )


if __name__ == "__main__":
    main()
