"""fp8 matmuls against bf16 on this device: TFLOP/s and error of named-tensors' fp8 Linear matmul.

Prints one JSON line. Run: `uv run python bench/fp8_matmul.py --size 8192` (on a GPU; `bench/device_check.py`
runs it as its fp8 row there). The reference is a bf16 matmul of the same shape timed in the same run; the
figures are named-tensors' fp8 matmul (`fp8_dot`, current scaling: the amaxes, the casts to e4m3 and the
rescale included) and the bare e4m3 dot alone (operands cast beforehand, f32 accumulation), each as a ratio
over bf16's time, the relative error of the fp8 product against f32, and whether the compiled program keeps
e4m3 operands in its matmul (on a GPU, the fp8 tensor-core GEMM; XLA:CPU widens them, so there the figures
measure an emulation).
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
from common import best_of, emit, log

import named_tensors as nt
from named_tensors.nn.quantized_matmul import E4M3, fp8_dot


def _ready(fn: Any, *args: Any) -> Any:
    return lambda: jax.block_until_ready(fn(*args))


def _keeps_fp8(compiled_text: str) -> bool:
    # The matmul instruction (dot, or the GEMM custom call it becomes on a GPU) still takes e4m3 operands.
    return any("f8e4m3fn" in line and ("dot(" in line or "custom-call" in line) for line in compiled_text.splitlines())


def measure(size: int, repeats: int) -> dict[str, Any]:
    """Times of bf16, named-tensors' fp8 and the bare e4m3 dot at size³, the fp8 error, and the compiled check."""
    key_x, key_w = jax.random.split(jax.random.key(0))
    Batch, Embed, Mlp = nt.Axis("batch", size), nt.Axis("embed", size), nt.Axis("mlp", size)
    x32 = jax.random.normal(key_x, (size, size), jnp.float32)
    w32 = jax.random.normal(key_w, (size, size), jnp.float32) / size**0.5
    x = nt.NamedArray(x32.astype(jnp.bfloat16), (Batch, Embed))
    w = nt.NamedArray(w32.astype(jnp.bfloat16), (Mlp, Embed))
    bf16 = jax.jit(lambda a, b: nt.dot(a, b, axis="embed"))
    fp8 = jax.jit(lambda a, b: fp8_dot(a, b, (Embed,), (Mlp,)))
    dims = (((1,), (1,)), ((), ()))
    bare = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32))
    x8, w8 = x32.astype(E4M3), w32.astype(E4M3)  # values within e4m3's range: no scale needed to time the dot
    flops = 2 * size**3
    times = {}
    for name, fn, args in (("bf16", bf16, (x, w)), ("fp8", fp8, (x, w)), ("fp8_bare_dot", bare, (x8, w8))):
        _ready(fn, *args)()  # compile and warm up
        times[name] = best_of(repeats, _ready(fn, *args))
        log(f"fp8_matmul: {name} {flops / times[name] / 1e12:.1f} TFLOP/s")
    exact = x32 @ w32.T
    got = fp8(x, w).array.astype(jnp.float32)
    error = float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact))
    return {
        "size": size,
        "bf16_tflops": flops / times["bf16"] / 1e12,
        "fp8_tflops": flops / times["fp8"] / 1e12,
        "fp8_bare_dot_tflops": flops / times["fp8_bare_dot"] / 1e12,
        "fp8_bare_over_bf16_time": times["fp8_bare_dot"] / times["bf16"],
        "fp8_relative_error": error,
        "fp8_operands_in_compiled_dot": _keeps_fp8(fp8.lower(x, w).compile().as_text()),
        "seconds": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="the square matmul's side (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls of each, the best kept")
    args = parser.parse_args()
    figures = measure(args.size, args.repeats)
    ratio = figures["seconds"]["fp8"] / figures["seconds"]["bf16"]
    emit("fp8_matmul", figures, reference="bf16 matmul of the same shape, same run", ratio=ratio)


if __name__ == "__main__":
    main()
