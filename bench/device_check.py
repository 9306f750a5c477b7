"""The check to run on the first accelerator lent: the device tests, the train step, absolute MFU, and memory.

Run: `uv run python bench/device_check.py` (under 8 minutes on one GPU; writes device_check.json, `--out`
moves it). The same script runs on CPU at small shapes, as CI runs it.

1. The tests that touch devices (attention, blockwise attention, sharding, the loss, precision), run by pytest on
   this machine's default backend (on an accelerator with f32 matmuls at full precision, since they compare f32
   results closely; those that need more devices than it has skip): their counts and the tail of their output.
2. The lm-train train step (bench/train_step.py's `Ours`: the trainer's own state, step, mesh and donation),
   on an accelerator at GPT-2-small (768 wide, 12 layers, seq 1024, batch 32) and Llama-1B shapes (2048 wide, 16
   layers, 32 heads, 8 kv heads, seq 2048, batch 8, gradient checkpointing) in `p=f32,c=bfloat16`; on CPU at the
   nano shapes in f32. For each: tokens/s, the absolute MFU (against the chip's data-sheet bf16 peak from
   lm_train.run.chips; on CPU the trainer's measured denominator), the device's peak memory from
   `memory_stats()` (None on CPU, which keeps none), `lm-train plan`'s estimate of that peak for the same config
   and XLA's own (`plan --compile`: compiled.memory_analysis()), with their ratios.
3. On a GPU, an fp8 row: bench/fp8_matmul.py at 8192³ (named-tensors' fp8 matmul and the bare e4m3 dot against
   bf16, the fp8 error, and whether the compiled GEMM keeps e4m3 operands); elsewhere it is skipped, saying why.
4. With `--variants`, the same step with one setting changed (no gradient checkpointing, our own attention
   instead of cuDNN's): what each default is worth on this device; and GPT-2-small's unrolled layers with
   gradient checkpointing, whose peak the plan must be checked against here (XLA:CPU ignores the remat there).

Each row runs in a process of its own, so that `memory_stats()`'s peak is that row's alone and an out-of-memory
at one shape cannot hide the others; the report is rewritten after every row, so a run cut short keeps what
it measured. The parent opens no device (a TPU admits one process at a time): a short process reads the backend.
A variant that `lm-train plan` says will not fit is skipped, and a row not begun by `--deadline` (470 s) skips.
Where the machine has an NVIDIA GPU or a TPU but jax sees only its CPU (jax installed without the plugin), the
check stops and says so rather than time the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
from common import log, machine_info
from train_step import CPU_SHAPES, Ours, Shape

from lm_train.planning.report import plan_json
from lm_train.planning.setup import plan_for
from lm_train.run import chips as lm_chips
from lm_train.run.host_memory import restart_with_hugepage_malloc

ROOT = Path(__file__).resolve().parents[1]
DEVICE_TESTS = [
    "packages/named-tensors/tests/test_nn_attention.py",
    "packages/named-tensors/tests/test_nn_blockwise_attention.py",
    "packages/named-tensors/tests/test_nn_fused_attention.py",
    "packages/named-tensors/tests/test_sharding.py",
    "packages/lm-models/tests/test_loss_and_flash.py",
    "apps/train/tests/test_precision.py",
]
ACCELERATOR_SHAPES = {
    "gpt2_small": (Shape(hidden=768, layers=12, heads=12, seq=1024, vocab=50257, batch=32), False),
    "llama_1b": (
        Shape(2048, 16, 32, 2048, 128256, 8, family="llama", kv_heads=8, mlp=8192),
        True,  # gradient checkpointing: a 1B model's activations at 16k tokens would not fit without it
    ),
}
CPU_CHECK_SHAPES = {"gpt2_nano": (CPU_SHAPES["nano"], False), "llama_nano": (CPU_SHAPES["llama_nano"], False)}
# name: (base row, gradient checkpointing, the model settings changed, with the plan)
ACCELERATOR_VARIANTS = {
    "llama_1b.no_remat": ("llama_1b", False, {}, False),
    "llama_1b.vanilla_attention": ("llama_1b", True, {"attn_backend": "vanilla"}, False),
    # Does remat take with unrolled layers here? On CPU it does not (docs/scaling.md): measured against the plan.
    "gpt2_small.unrolled_remat": ("gpt2_small", True, {"scan_layers": False}, True),
}
CPU_VARIANTS = {"llama_nano.blockwise_attention": ("llama_nano", False, {"attn_backend": "jax_flash"}, False)}
# The parent, and the tests it starts, hold no device memory until they need it (XLA preallocates most of a GPU's
# in the first process to touch it); each row's process gets the caller's environment back, so that it is
# measured as a training run allocates.
NO_PREALLOCATION = "XLA_PYTHON_CLIENT_PREALLOCATE"
BASE_ROWS = set(ACCELERATOR_SHAPES) | set(CPU_CHECK_SHAPES)  # always measured; a variant the plan rejects skips
MIN_ROW_S = 45.0  # a row needs about this much to compile and time at least a step


TEST_OPTIONS = "--import-mode=importlib -ra -n 4 --dist loadfile"


def run_tests(paths: list[str], timeout_s: float, on_cpu: bool) -> dict[str, Any]:
    """pytest on the device tests, on this machine's default backend; their counts and the end of the output."""
    env = dict(os.environ)
    if not on_cpu:
        # conftest.py pins the suite to 8 CPU devices unless JAX_PLATFORMS is set: set, empty, jax takes its
        # default backend (the accelerator). The tests compare f32 results at rtol ~1e-5, which TF32 matmuls
        # (a GPU's default precision for f32) would miss.
        env |= {"JAX_PLATFORMS": "", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    started = time.perf_counter()
    try:
        done = subprocess.run(
            # Our own options rather than the project's addopts: an accelerator machine's pytest-xdist may not
            # know all of theirs.
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", f"addopts={TEST_OPTIONS}", *paths],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
        output, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        output, status = f"{e.stdout or ''}\ntimed out after {timeout_s:.0f} s", None
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    return {
        "files": paths,
        "exit_status": status,
        "counts": counts,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summary,
        "output_tail": output[-3000:] if status != 0 else "",
    }


def peak_memory() -> int | None:
    """The first device's peak bytes in use since the process started (None where jax keeps no statistics)."""
    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def check_shape(
    name: str,
    shape: Shape,
    remat: bool,
    mp: str,
    steps: int,
    overrides: dict[str, Any],
    with_plan: bool,
    always: bool = True,
) -> dict[str, Any]:
    """Time `steps` steps of the lm-train step at one shape, after two that compile; MFU, memory, plan. Unless
    `always`, a row that `lm-train plan` says will not fit is skipped rather than run out of memory."""
    log(f"device_check[{name}]: {shape}, mp {mp}, gradient checkpointing {remat}, settings {overrides}")
    if not always:
        config = Ours.config_for(shape, mp, steps + 2, "scan", remat=remat, **overrides)
        planned = plan_json(plan_for(config, None, vocab_size=shape.vocab)[0])
        if not planned["fits"]:
            peak = planned["peak_bytes_per_device"]
            return {"skipped": f"lm-train plan: does not fit ({peak / 2**30:.1f} GiB peak)", "plan_peak_bytes": peak}
    ours = Ours(shape, mp, steps + 2, "scan", remat=remat, **overrides)
    batch = ours.batch(np.random.default_rng(0).integers(0, shape.vocab, (shape.batch, shape.seq), dtype=np.int32))
    started = time.perf_counter()
    losses = [ours.step(batch) for _ in range(2)]
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    losses += [ours.step(batch) for _ in range(steps)]
    step_s = (time.perf_counter() - started) / steps
    tokens_per_s = shape.batch * shape.seq / step_s
    flops_per_token = ours.model_config.flops_per_token(shape.vocab)
    device = jax.devices()[0]
    peak = lm_chips.peak_flops_per_device(device) * jax.device_count()
    measured = peak_memory()
    row = {
        "shape": dataclasses.asdict(shape),
        "model_settings": overrides,
        "gradient_checkpointing": remat,
        "mp": mp,
        "timed_steps": steps,
        "compile_and_first_two_steps_s": round(compile_s, 2),
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens_per_s, 1),
        "flops_per_token": flops_per_token,
        "mfu": round(tokens_per_s * flops_per_token / peak, 4),
        "peak_flops": peak,
        "peak_means": "data-sheet dense bf16 peak" if device.platform != "cpu" else "the trainer's measured CPU peak",
        "losses": [round(x, 4) for x in losses],
        "loss_finite": all(x == x and abs(x) != float("inf") for x in losses),
        "memory_stats_peak_bytes": measured,
    }
    if with_plan:
        plan, xla = plan_for(ours.config, None, vocab_size=shape.vocab, compile_check=True)
        planned = plan_json(plan, xla)
        row |= {
            "plan_peak_bytes_per_device": planned["peak_bytes_per_device"],
            "xla_peak_bytes_per_device": planned["xla_peak_bytes_per_device"],  # compiled.memory_analysis()
            "plan_over_xla": round(planned["estimate_over_xla"], 3) if planned["estimate_over_xla"] else None,
            "plan_over_measured": round(planned["peak_bytes_per_device"] / measured, 3) if measured else None,
        }
    return row


def rows_for(on_cpu: bool, variants: bool) -> dict[str, tuple[Shape, bool, dict[str, Any], bool]]:
    """name: (shape, gradient checkpointing, model settings, with the plan) for every row this device runs."""
    shapes = CPU_CHECK_SHAPES if on_cpu else ACCELERATOR_SHAPES
    rows = {name: (shape, remat, {}, True) for name, (shape, remat) in shapes.items()}
    for name, (base, remat, overrides, with_plan) in (CPU_VARIANTS if on_cpu else ACCELERATOR_VARIANTS).items():
        if variants:
            rows[name] = (shapes[base][0], remat, overrides, with_plan)
    return rows


def run_row(name: str, steps: int, timeout_s: float, variants: bool, env: dict[str, str]) -> dict[str, Any]:
    """One row, measured in a process of its own (its JSON comes back through a file)."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"device_check.{os.getpid()}.{name}.json"
    command = [sys.executable, __file__, "--row", name, "--steps", str(steps), "--out", str(out)]
    try:
        done = subprocess.run([*command, *(["--variants"] if variants else [])], env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if done.returncode != 0 or not out.exists():
        return {"error": f"the row's process exited with status {done.returncode} (its output is above)"}
    row = json.loads(out.read_text(encoding="utf-8"))
    out.unlink()
    return row


FP8_SIZE = 8192  # large enough that the GEMM, not the casts and the launch, sets the time on a GPU


def fp8_row(backend: str, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """bench/fp8_matmul.py (fp8 against bf16) in a process of its own on a GPU; elsewhere skipped, saying why."""
    if backend != "gpu":
        return {
            "skipped": f"fp8 matmuls are timed on a GPU's fp8 tensor cores (Hopper or newer); the {backend} "
            "backend only emulates the fp8 formats, so a time there says nothing"
        }
    if timeout_s < MIN_ROW_S:
        return {"skipped": f"out of time: {timeout_s:.0f} s left"}
    command = [sys.executable, str(ROOT / "bench" / "fp8_matmul.py"), "--size", str(FP8_SIZE)]
    try:
        done = subprocess.run(command, env=env, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"bench/fp8_matmul.py exited with status {done.returncode}: {done.stderr[-2000:]}"}
    return json.loads(lines[-1])


def describe_devices() -> dict[str, Any]:
    """The default backend, its first device and the machine (machine_info), as the `--probe` process sees them."""
    device = jax.devices()[0]
    on_cpu = jax.default_backend() == "cpu"
    chip = None if on_cpu else lm_chips.chip_for_kind(getattr(device, "device_kind", ""))
    return {
        "backend": jax.default_backend(),
        "device_kind": getattr(device, "device_kind", device.platform),
        "chip": chip.name if chip is not None else None,
        "chip_bf16_peak_flops": chip.bf16_flops if chip is not None else None,
        **machine_info(),
    }


def probe_devices(timeout_s: float) -> dict[str, Any]:
    """describe_devices() from a process of its own: the parent never opens a device, since a TPU admits one
    process at a time and the tests and every row need it."""
    command = [sys.executable, __file__, "--probe"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"device_check: could not start jax's backend:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def accelerator_present(dev: Path = Path("/dev")) -> str | None:
    """The accelerator this machine has by its device files (NVIDIA GPU, TPU), whatever jax sees; None if none."""
    if (dev / "nvidia0").exists() or (dev / "nvidiactl").exists():
        return "an NVIDIA GPU"
    if any(dev.glob("accel[0-9]*")) or any((dev / "vfio").glob("[0-9]*")):
        return "a TPU"
    return None


def main() -> None:
    warnings.filterwarnings("ignore", message=".*mesh.*context manager.*deprecated", category=DeprecationWarning)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="device_check.json", help="the JSON file written (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per shape, after two that compile")
    parser.add_argument("--tests", action=argparse.BooleanOptionalAction, default=True, help="run the device tests")
    parser.add_argument("--tests-timeout", type=float, default=180.0, help="seconds the device tests may take")
    parser.add_argument(
        "--test-files", nargs="+", default=DEVICE_TESTS, help="the test files run (default: the device tests above)"
    )
    parser.add_argument("--variants", action="store_true", help="also the rows with one setting changed")
    parser.add_argument("--row-timeout", type=float, default=240.0, help="seconds one row may take")
    parser.add_argument(
        "--deadline", type=float, default=470.0, help="seconds the whole check may take; rows not begun by then skip"
    )
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run on jax's CPU backend even where an accelerator is present"
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: measure this one row, in this process
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # internal: describe_devices()
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(describe_devices()))
        return
    if args.row is not None:
        on_cpu = jax.default_backend() == "cpu"
        shape, remat, overrides, with_plan = rows_for(on_cpu, args.variants)[args.row]
        mp = "f32" if on_cpu else "p=f32,c=bfloat16"
        row = check_shape(args.row, shape, remat, mp, args.steps, overrides, with_plan, args.row in BASE_ROWS)
        Path(args.out).write_text(json.dumps(row) + "\n", encoding="utf-8")
        return
    started = time.perf_counter()
    row_env = dict(os.environ)  # the rows' processes allocate as the caller's environment says
    os.environ[NO_PREALLOCATION] = "false"  # for the probe and the tests, which inherit it
    machine = probe_devices(args.deadline)
    on_cpu = machine["backend"] == "cpu"
    accelerator = accelerator_present()
    if on_cpu and accelerator and not args.allow_cpu:
        raise SystemExit(
            f"device_check: this machine has {accelerator}, but jax sees only its CPU: this environment's jax has "
            "no plugin for it (in this workspace: uv sync --extra gpu, or --extra tpu; on a lent machine with "
            "jax preinstalled: bench/device_setup). --allow-cpu runs the CPU check anyway."
        )
    report: dict[str, Any] = {
        "name": "device_check",
        **{k: machine.pop(k) for k in ("device_kind", "chip", "chip_bf16_peak_flops")},
        "tests": run_tests(args.test_files, args.tests_timeout, on_cpu) if args.tests else None,
        "train_step": {},
    }
    report.update(machine)
    for name in rows_for(on_cpu, args.variants):
        left = args.deadline - (time.perf_counter() - started)
        if left < MIN_ROW_S:
            row = {"skipped": f"out of time: {left:.0f} s of the {args.deadline:.0f} s deadline left"}
        else:
            row = run_row(name, args.steps, min(args.row_timeout, left), args.variants, row_env)
        report["train_step"][name] = row
        if "error" in row or "skipped" in row:
            log(f"device_check[{name}]: {row.get('error') or 'skipped: ' + row['skipped']}")
        report["seconds"] = round(time.perf_counter() - started, 1)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    left = args.deadline - (time.perf_counter() - started)
    report["fp8_matmul"] = fp8_row(machine["backend"], min(args.row_timeout, left), row_env)
    log(f"device_check[fp8_matmul]: {report['fp8_matmul']}")
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    for name, row in report["train_step"].items():
        log(f"device_check[{name}]: " + ", ".join(f"{k} {row.get(k)}" for k in ("tokens_per_s", "mfu", "error")))
    tests = report["tests"]
    if tests is not None:
        log(f"device_check: tests {tests['summary']}")
    log(f"device_check: wrote {os.path.abspath(args.out)} in {report['seconds']} s")


if __name__ == "__main__":
    restart_with_hugepage_malloc()  # as `lm-train` starts: the step's buffers on huge pages
    main()
