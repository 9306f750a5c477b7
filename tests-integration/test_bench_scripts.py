"""The benchmark scripts still run and print their JSON lines (tiny sizes; no timing is judged here).

Benchmarks are not tests: these only keep the scripts from rotting as the packages change, and check the
correctness facts the train-step benchmark relies on: its reference computes the same losses as ours, and the
run's step with its optional features off is the same program as the bare step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST_COMPILE_FLAG

BENCH = Path(__file__).parents[1] / "bench"
COMMON_KEYS = {"name", "reference", "ratio", "ratio_means", "cpu_count", "device", "jax_version", "commit"}


def bench_env() -> dict[str, str]:
    """The environment a benchmark runs in: one CPU device, as a user runs them, at the session's LLVM level (the
    root conftest's -O0 halves the CPU time of the compiles; ours and the reference compile alike)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if FAST_COMPILE_FLAG in os.environ.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = FAST_COMPILE_FLAG
    return env


def run_bench(script: str, *args: str, timeout: float = 300) -> list[dict]:
    """The JSON lines `bench/<script>.py ARGS` prints, after checking that it succeeded."""
    env = bench_env()
    done = subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, f"bench/{script}.py failed:\n{done.stderr[-4000:]}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert lines, f"bench/{script}.py printed no JSON line; stderr:\n{done.stderr[-2000:]}"
    for line in lines:
        assert set(line) >= COMMON_KEYS, f"{script}: {sorted(COMMON_KEYS - set(line))} missing from {line}"
    return lines


def test_peak_reports_every_size_and_its_best():
    (line,) = run_bench("peak", "--sizes", "64", "128", "--repeats", "1", "--budget", "0.05")
    assert line["f32_best_gflops"] == max(line["f32_64_gflops"], line["f32_128_gflops"]) > 0


def test_train_step_reference_computes_our_losses_with_every_layout():
    lines = run_bench(
        "train_step",
        *("--shapes", "nano", "--rounds", "1", "--peak-budget", "0.05", "--batch", "4", "--seq", "32"),
        *("--layers", "scan", "scan_unrolled", "unrolled"),
    )
    assert [line["name"] for line in lines] == [
        "train_step.nano",
        "train_step.nano.torch_peer",
        "train_step.nano_scan_unrolled",
        "train_step.nano_unrolled",
        "train_step.features_off",
    ]
    for line in (lines[0], *lines[2:4]):
        assert line["same_loss"] is True, line
        assert 0 < line["ours_mfu"] < 1 and line["ours_tokens_per_s"] > 0
        assert 0 < line["ours_mfu_same_window"] < 1 and line["peak_same_window_gflops"] > 0
    # Hugging Face's GPT-2 on torch eager, from our weights, computes our first two losses (to f32 rounding).
    peer = lines[1]
    assert peer["same_loss"] is True and peer["loss_step1_torch"] != peer["loss_step2_torch"], peer
    assert peer["reference"]["torch_tokens_per_s"] > 0 and peer["ratio"] > 0
    # The run's step with each optional feature off is the bare step's program; turning one on changes it.
    off = lines[4]
    assert off["features_off_program_identical"] == dict.fromkeys(
        ("all_defaults", "watch", "fcm_prob", "profiler", "eval_harness"), True
    )
    assert off["feature_on_program_differs"] == {"watch": True, "fcm_prob": True}
    assert off["hooks_off_host_us_per_step"] > 0 and off["ratio"] > 0


def test_train_step_llama_and_mixtral_references_compute_our_losses():
    lines = run_bench(
        "train_step",
        *("--shapes", "llama_nano", "mixtral_nano", "--rounds", "1", "--peak-budget", "0.05", "--batch", "2"),
        *("--seq", "16", "--no-features-off"),
    )
    assert [line["name"] for line in lines] == ["train_step.llama_nano", "train_step.mixtral_nano"]
    for line in lines:
        assert line["same_loss"] is True, line
    assert "dispatch_share_of_reference_step" in lines[1] and lines[1]["reference_ideal_dispatch_step_s_mean"] > 0


def test_compile_time_compares_both_layouts():
    lines = run_bench("compile_time", "--layers", "2", "3", "--repeats", "1")
    assert lines[-1]["ratio"] > 0


def test_packed_attention_compares_segment_ids_with_the_whole_mask():
    lines = run_bench("packed_attention", "--seq-len", "256", "--batch", "2", "--documents", "3", "--repeats", "1",
                      "--kernels", "jax_flash", "vanilla")  # fmt: skip
    assert [line["name"] for line in lines] == ["packed_attention.jax_flash", "packed_attention.vanilla"]
    assert all(line["same_loss"] and line["ratio"] > 0 for line in lines)
    # Blockwise attention takes the ids and builds no (batch, position, key_position) mask.
    assert lines[0]["segment_ids_bytes"] < lines[0]["whole_mask_bytes"]


def test_cache_build_and_loader_run_on_a_small_corpus():
    (build,) = run_bench("cache_build", "--mb", "0.3", "--shards", "2", "--vocab", "512", "--repeats", "1")
    assert build["ratio"] > 0
    loader = run_bench("loader", "--docs", "300", "--shards", "2", "--seq-len", "64", "--repeats", "1")
    assert all(line["ratio"] > 0 for line in loader)


def test_data_mixing_traces_every_era_to_its_source_files():
    (line,) = run_bench("data_mixing", "--max-files", "40", "--vocab", "300", "--era", "64", "--steps", "32")
    assert line["files_total"] == 40 and line["eras"] == 32 * 32 // 64
    # each era draws from several of the 40 files; a full permutation from about as many or more
    assert all(1 < files <= 40 for files in line["files_per_era"] + line["full_shuffle_files_per_era"])
    assert 0 < line["ratio"] <= 1.5


def test_checkpoint_saves_and_loads_a_few_mib(tmp_path):
    lines = run_bench("checkpoint", "--mib", "8", "--repeats", "1", "--dir", str(tmp_path))
    assert all(line["ratio"] > 0 for line in lines)


def test_hf_export_reports_throughput_and_peak_memory(tmp_path):
    (line,) = run_bench("hf_export", "--hidden", "64", "--layers", "2", "--repeats", "1", "--dir", str(tmp_path))
    assert line["save_ratio"] > 0 and line["load_ratio"] > 0 and line["peak_over_largest_tensor"] > 0


def test_device_check_runs_on_cpu_at_small_shapes_and_writes_one_json_file(tmp_path):
    out = tmp_path / "device_check.json"
    tests = ["--test-files", "packages/named-tensors/tests/test_nn_masks.py"]
    args = ["--out", str(out), "--steps", "1", "--variants", *tests]
    env = bench_env()
    done = subprocess.run(
        [sys.executable, str(BENCH / "device_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["tests"]["exit_status"] == 0 and report["tests"]["counts"]["passed"] > 0, report["tests"]
    assert "fp8 tensor cores" in report["fp8_matmul"]["skipped"]  # the fp8 row runs on a GPU alone
    rows = report["train_step"]
    assert set(rows) == {"gpt2_nano", "llama_nano", "llama_nano.blockwise_attention"}
    assert rows.pop("llama_nano.blockwise_attention")["model_settings"] == {"attn_backend": "jax_flash"}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["loss_finite"], row
        assert row["memory_stats_peak_bytes"] is None  # the CPU keeps no statistics; an accelerator does
        # plan's estimate next to XLA's own for the same step (plan's tests hold it within 15%)
        assert 0.85 < row["plan_over_xla"] < 1.15, row


def test_device_check_knows_a_gpu_or_tpu_by_its_device_files(tmp_path, monkeypatch):
    # Where one is present but jax sees only the CPU (jax without its plugin), device_check stops instead of
    # timing the CPU.
    monkeypatch.syspath_prepend(str(BENCH))
    from device_check import accelerator_present

    assert accelerator_present(tmp_path) is None
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "0").touch()
    assert accelerator_present(tmp_path) == "a TPU"
    (tmp_path / "nvidiactl").touch()
    assert accelerator_present(tmp_path) == "an NVIDIA GPU"


IMPORTED_DISTRIBUTIONS = """
import importlib.metadata, importlib.util, json, sys
sys.path.insert(0, "bench")
sys.argv = ["device_check.py"]
import device_check
# conftest.py and the device tests' modules, imported by path as pytest would (pytest's own plugins, loaded by
# entry point, differ between machines and are left out).
for path in ["conftest.py", *device_check.DEVICE_TESTS]:
    sys.path.insert(0, path.rpartition("/")[0] or ".")  # the tests' own helper modules sit beside them
    spec = importlib.util.spec_from_file_location(path.replace("/", "_")[:-3], path)
    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
modules = {name.split(".")[0] for name in sys.modules} - set(sys.stdlib_module_names)
owners = importlib.metadata.packages_distributions()
print(json.dumps(sorted({dist for module in modules for dist in owners.get(module, [])})))
"""


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_device_wheels_carry_every_distribution_device_check_imports_that_the_gpu_image_lacks():
    # A new runtime dependency would otherwise first show up as an ImportError on a lent GPU machine, whose image
    # has no network to fetch it.
    done = subprocess.run(
        [sys.executable, "-c", IMPORTED_DISTRIBUTIONS], capture_output=True, text=True, timeout=300, cwd=BENCH.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported = {_normalized(d) for d in json.loads(done.stdout.strip().splitlines()[-1])}
    image = {_normalized(line) for line in (BENCH / "device_image_packages.txt").read_text().split("\n")}
    wheels_script = (BENCH / "device_wheels").read_text()
    carried = {_normalized(n) for key in ("third_party=(", "workspace=(") for n in _bash_array(wheels_script, key)}
    assert {"jax", "equinox", "optax", "draccus"} <= imported  # what lm_train and the models import, seen
    assert imported - image - carried == set()


def _bash_array(script: str, key: str) -> list[str]:
    start = script.index(key) + len(key)
    return script[start : script.index(")", start)].split()


def test_serve_compares_batching_decoding_and_memory_with_their_references():
    lines = run_bench("serve", "--concurrent", "4", "--decode-tokens", "4", "--load-clients", "4")
    names = ["serve.continuous_batching", "serve.decode_batch1", "serve.memory", "serve.load"]
    assert [line["name"] for line in lines] == names
    assert all(line["ratio"] > 0 for line in lines)
    assert lines[2]["peak_pages"] > 0
    assert lines[3]["clients"] == 4 and lines[3]["ttft"]["p50_ms"] > 0


def test_pipeline_bench_reports_both_layouts_and_the_bubble():
    args = ("--batch", "8", "--seq", "16", "--hidden", "32", "--layers", "2", "--microbatches", "2", "--rounds", "1")
    (line,) = run_bench("pipeline", *args)
    assert line["name"] == "pipeline.stage2_data4" and line["device_count"] == 8
    assert line["pipeline_tokens_per_s"] > 0 and line["data8_tokens_per_s"] > 0
    assert line["bubble_formula"] == round(1 / 3, 4)  # (2 - 1) / (2 + 2 - 1)
    assert abs(line["bubble_measured"] - (1 - line["data8_step_s"] / line["pipeline_step_s"])) < 2e-3


def test_context_parallel_reports_both_layouts_tokens_per_second():
    (line,) = run_bench(
        "context_parallel",
        *("--seq", "32", "--batch", "8", "--hidden", "32", "--layers", "1", "--steps", "1", "--rounds", "1"),
    )
    assert line["name"] == "context_parallel.nano" and line["device_count"] == 8
    ours, reference = line["context4_data2_tokens_per_s"], line["reference"]["data8_tokens_per_s"]
    assert ours > 0 and reference > 0
    assert line["ratio"] == pytest.approx(ours / reference, rel=1e-3)


def test_expert_parallel_reports_both_layouts_tokens_per_second():
    (line,) = run_bench("expert_parallel", *("--hidden", "32", "--layers", "1", "--seq", "16", "--batch", "16"),
                        *("--steps", "1", "--rounds", "1"))  # fmt: skip
    assert line["name"] == "expert_parallel.mixtral_nano" and line["device"].startswith("cpu")
    assert line["expert_tokens_per_s"] > 0 and line["data_tokens_per_s"] > 0
    assert abs(line["ratio"] - line["expert_tokens_per_s"] / line["data_tokens_per_s"]) < 1e-3 * line["ratio"]


def test_recipes_reports_each_optimizer_against_adamw():
    tiny = ["--steps", "2", "--batch", "4", "--seq-len", "32", "--hidden", "32", "--layers", "1", "--vocab", "300"]
    args = [*tiny, "--max-files", "10", "--eval-batches", "1", "--sweep", "--optimizers", "muon"]
    lines = run_bench("recipes", *args, timeout=600)
    assert [line["name"] for line in lines] == ["recipes.adam", "recipes.muon"]
    adam, muon = lines
    assert adam["ratio"] == 1.0 and adam["step_time_ratio"] == 1.0
    assert 0 < muon["ratio"] < 10 and muon["step_time_ratio"] > 0
    assert muon["eval_loss_docs_lr"] == muon["eval_loss_best_lr"] and muon["docs_lr"] == 0.02
