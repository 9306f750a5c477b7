"""`lm-train plan`: device specs, the JSON and text reports, the verdict with its smallest changes, bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import shard_cache
from lm_train.cli import app
from lm_train.config import load_train_config
from lm_train.errors import UserError
from lm_train.planning.devices import parse_devices
from lm_train.planning.plan import make_plan
from lm_train.planning.report import plan_json, render_text
from lm_train.run.chips import chip_named

CONFIG = str(Path(__file__).parents[3] / "configs" / "gpt2_nano.yaml")
TINY = ["--model.hidden_dim", "32", "--model.num_layers", "2", "--model.num_heads", "2", "--model.seq_len", "16"]
TINY += ["--trainer.train_batch_size", "8", "--vocab-size", "64"]
# GPT-2 medium-ish at 2048 positions without remat: its saved attention scores alone outgrow an H100.
TOO_BIG = ["--model.hidden_dim", "1024", "--model.num_heads", "16", "--model.num_layers", "8"]
TOO_BIG += ["--model.seq_len", "2048", "--model.gradient_checkpointing", "false", "--trainer.train_batch_size", "128"]


def plan(*args: str):
    return CliRunner().invoke(app, ["plan", CONFIG, *args])


SPECS = [("8xH100", 8, "H100", 1), ("64xH200", 64, "H200", 1), ("4x8xA100", 32, "A100-40", 4)]
SPECS += [("v4-256", 128, "v4", 32), ("v5e-64", 64, "v5e", 16), ("cpu:8", 8, None, 1)]


@pytest.mark.parametrize(("text", "count", "chip", "hosts"), SPECS)
def test_device_specs_name_hardware_that_is_not_here(text, count, chip, hosts):
    spec = parse_devices(text)
    assert (spec.count, spec.hosts) == (count, hosts)
    assert spec.chip == (chip_named(chip) if chip else None)
    if chip:
        assert spec.memory_bytes == spec.chip.hbm_bytes


@pytest.mark.parametrize("text", ["8xH1000", "banana", "v4-3", "0xH100", "cpu:0", "v4-0", "0x8xA100"])
def test_a_bad_device_spec_is_a_clear_error(text):
    with pytest.raises(UserError, match="--devices"):
        parse_devices(text)
    result = plan("--devices", text, *TINY)
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    message = result.output
    assert "--devices" in message and text in message
    assert all(form in message for form in ("cpu:8", "8xH100", "4x8xA100", "v4-256"))  # the accepted forms


def test_plan_json_for_hardware_that_is_not_here_and_the_xla_cross_check():
    result = plan("--devices", "8xH100", "--json", *TINY)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["fits"] is True and out["device_count"] == 8 and out["mesh"]["data"] == 8
    assert out["peak_bytes_per_device"] > out["parameters_bytes"] + out["optimizer_state_bytes"]
    assert out["memory_bytes_per_device"] == 80 * 2**30
    assert set(out["policies"]) >= {"none", "full"}
    assert "xla_peak_bytes_per_device" not in out

    checked = plan("--json", "--compile", *TINY)  # on the present devices: the session's 8 CPU devices
    assert checked.exit_code == 0, checked.output
    out = json.loads(checked.output)
    assert out["devices"] == "cpu:8"
    xla = out["xla_peak_bytes_per_device"]
    assert xla >= out["xla"]["argument_bytes"] > 0
    assert out["estimate_over_xla"] == pytest.approx(out["peak_bytes_per_device"] / xla)


def test_with_compile_the_verdict_is_xlas_figure_not_the_estimate(monkeypatch):
    monkeypatch.delenv("LM_TRAIN_MEMORY_LIMIT", raising=False)
    first = json.loads(plan("--json", "--compile", *TINY).output)
    estimate, xla = first["peak_bytes_per_device"], first["xla_peak_bytes_per_device"]
    assert estimate != xla
    between = (estimate + xla) // 2  # a limit that one figure fits and the other does not
    monkeypatch.setenv("LM_TRAIN_MEMORY_LIMIT", str(between))
    out = json.loads(plan("--json", "--compile", *TINY).output)
    assert out["usable_bytes_per_device"] == between and out["usable_why"] == "LM_TRAIN_MEMORY_LIMIT"
    assert out["fits"] is (xla <= between) and out["margin_bytes"] == between - xla
    assert out["compiled_peak_bytes"] == xla
    without = json.loads(plan("--json", *TINY).output)  # no compile: the estimate decides, the other way
    assert without["fits"] is (estimate <= between) is not out["fits"]
    text = plan("--compile", *TINY).output
    (verdict,) = [line for line in text.splitlines() if "verdict:" in line]
    assert "XLA's peak" in verdict and ("does not fit" in verdict) is (xla > between)


def test_compile_refuses_hardware_that_is_not_here():
    result = plan("--devices", "8xH100", "--compile", *TINY)
    assert result.exit_code == 2
    assert "Traceback" not in result.output and "--devices cpu:8" in result.output


def test_a_run_that_does_not_fit_gets_the_smallest_changes_that_do():
    config, _ = load_train_config([Path(CONFIG)], TOO_BIG)
    h100s = parse_devices("8xH100")
    found = make_plan(config, h100s, vocab_size=50257, vocab_from="GPT-2's tokenizer")
    out = plan_json(found)
    assert out["fits"] is False and out["margin_bytes"] < 0
    assert out["suggestions"], out
    text = render_text(found, CONFIG)
    assert "verdict: does not fit by" in text and all(change in text for change in out["suggestions"])
    # Each suggestion starts with the override that makes it fit: applied, the plan fits.
    first = out["suggestions"][0]
    override = first.split(":")[0].split()[:2]
    assert override[0].startswith("--")
    config, _ = load_train_config([Path(CONFIG)], [*TOO_BIG, *override])
    fixed = make_plan(config, h100s, vocab_size=50257, vocab_from="GPT-2's tokenizer", suggest=False)
    assert fixed.fits is True
    assert fixed.peak_bytes_per_device < found.peak_bytes_per_device


def test_mp_auto_plans_bf16_compute_on_accelerators_and_f32_on_cpu():
    for devices, mp in (("8xH100", "p=f32,c=bfloat16"), ("v4-16", "p=f32,c=bfloat16"), ("cpu:8", "f32")):
        result = plan("--devices", devices, "--json", *TINY, "--trainer.mp", "auto")
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["mp"] == mp, devices
    # bf16 compute holds less than the f32 the config file names, on the same H100s
    auto = json.loads(plan("--devices", "8xH100", "--json", *TINY, "--trainer.mp", "auto").output)
    f32 = json.loads(plan("--devices", "8xH100", "--json", *TINY).output)
    assert f32["mp"] == "f32" and auto["peak_bytes_per_device"] < f32["peak_bytes_per_device"]


def test_without_vocab_size_the_plan_reads_the_tokenizer_a_run_would_use(tmp_path):
    shape = TINY[: TINY.index("--vocab-size")]
    cache = ["--data.cache_dir", str(tmp_path / "cache")]
    # Before a first run has trained its BPE: data.vocab_size (the built-in corpus's 4096).
    first = plan("--json", *shape, *cache)
    assert first.exit_code == 0, first.output
    assert (json.loads(first.output)["vocab_size"], json.loads(first.output)["vocab_from"]) == (
        4096,
        "data.vocab_size (the BPE a first run trains)",
    )
    # Once it exists, the trained BPE's own size, read from the file.
    trained = tmp_path / "cache" / "tokenizer-bpe4096.json"
    trained.parent.mkdir()
    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(200)]
    size = shard_cache.train_tokenizer(texts, 300, save_path=str(trained)).get_vocab_size(with_added_tokens=True)
    after = json.loads(plan("--json", *shape, *cache).output)
    assert (after["vocab_size"], after["vocab_from"]) == (size, f"the trained tokenizer {trained}") and size != 4096
    # A configured tokenizer: a tokenizer.json, or the Hugging Face directory that holds one.
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "tokenizer.json").write_bytes(trained.read_bytes())
    for configured in (trained, hf_dir):
        result = plan("--json", *shape, "--data.tokenizer", str(configured))
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["vocab_size"] == size
    # One that is not on this machine: a clear error that names the fix.
    missing = plan("--json", *shape, "--data.tokenizer", str(tmp_path / "nowhere.json"))
    assert missing.exit_code != 0 and "Traceback" not in missing.output
    assert "nowhere.json is not on this machine" in missing.output and "--vocab-size" in missing.output


def test_an_accelerator_plan_counts_no_scores_where_a_fused_kernel_would_run():
    """On H100s with bf16 compute the default attention is cuDNN's fused kernel, on TPUs the splash kernel:
    planned here as ours blockwise, they keep no scores. Ours (attn_backend vanilla) materialises them."""
    auto = [*TINY, "--trainer.mp", "auto", "--model.seq_len", "512"]  # longer than one of ours blockwise's blocks
    gpu = json.loads(plan("--devices", "8xH100", "--json", *auto).output)
    ours = json.loads(plan("--devices", "8xH100", "--json", *auto, "--model.attn_backend", "vanilla").output)
    tpu = json.loads(plan("--devices", "v4-16", "--json", *auto).output)
    assert gpu["estimate"]["attention_kernels"] == ["cuDNN's fused kernel"]
    assert gpu["estimate"]["attention_scores_bytes"] == 0
    assert ours["estimate"]["attention_kernels"] == ["ours"] and ours["estimate"]["attention_scores_bytes"] > 0
    assert gpu["peak_bytes_per_device"] < ours["peak_bytes_per_device"]
    assert tpu["estimate"]["attention_kernels"] == ["the Pallas splash kernel"]
    assert tpu["estimate"]["attention_scores_bytes"] == 0 and not tpu["notes"]
    text = plan("--devices", "8xH100", *auto).output
    assert "not materialised; kernel: cuDNN's fused kernel" in text

    # Packed rows: the plan traces the batch the data gives (segment ids, positions, a loss mask), and the
    # splash kernel takes their segment ids. Forgetful causal masking adds a mask it cannot take: ours, noted.
    packed = json.loads(plan("--devices", "v4-16", "--json", *auto, "--data.pack", "true").output)
    assert packed["batch_fields"] == ["input_ids", "segment_ids", "positions", "loss_mask"]
    assert packed["batch_bytes"] == tpu["batch_bytes"] * 13 // 4  # int32 ids, segments and positions; bool mask
    assert packed["estimate"]["attention_kernels"] == ["the Pallas splash kernel"] and not packed["notes"]
    masked = json.loads(plan("--devices", "v4-16", "--json", *auto, "--data.pack", "true", "--fcm_prob", "0.1").output)
    assert masked["estimate"]["attention_kernels"] == ["ours"] and masked["estimate"]["attention_scores_bytes"] > 0
    assert any("other than packed rows' segment ids" in note for note in masked["notes"])
    assert (
        "(token ids, segment ids, positions, loss mask)"
        in plan("--devices", "v4-16", *auto, "--data.pack", "true").output
    )

    # Likewise the loss: a GPU scores a vocabulary of 32768 or more in blocks, so no full logits; a CPU does not.
    big = [*auto[: auto.index("--vocab-size")], "--vocab-size", "40000", "--trainer.mp", "auto"]
    on_gpu = json.loads(plan("--devices", "8xH100", "--json", *big).output)
    on_cpu = json.loads(plan("--devices", "cpu:8", "--json", *big).output)
    assert on_gpu["estimate"]["logits_bytes"] == 0 < on_cpu["estimate"]["logits_bytes"]


def test_a_lora_config_plans_on_every_device_kind_with_the_adapters_gradients():
    """LoRA's optimizer state holds moments for the adapters alone (a partitioned tree): the plan traces it on
    sharded layouts and counts gradients of the adapters only; on this CPU it is within 15% of XLA's peak."""
    lora = str(Path(CONFIG).parent / "sft_lora_nano.yaml")
    for devices in ("v4-16", "8xH100", None):
        flags = ["--json", "--vocab-size", "512", *(["--devices", devices] if devices else ["--compile"])]
        result = CliRunner().invoke(app, ["plan", lora, *flags])
        assert result.exit_code == 0, result.output
        planned = json.loads(result.output)
        assert 0 < planned["gradients_bytes"] < planned["parameters_bytes"] / 10  # rank-8 adapters
        assert planned["optimizer_state_bytes"] >= 2 * planned["gradients_bytes"]  # Adam's two moments
    assert abs(planned["peak_bytes_per_device"] / planned["xla_peak_bytes_per_device"] - 1) < 0.15


def test_dpo_plans_pairs_and_the_frozen_reference_model_within_15_percent_of_xla():
    """--dpo plans `lm-train dpo`'s step: chosen and rejected sequences, and a frozen reference model in the compute
    dtype beside the state (half the parameters' bytes in bf16); on this CPU within 15% of XLA's peak for it."""
    # gpt2_nano as shipped, on the suite's 8 CPU devices (at TINY's sizes fixed costs dominate: 0.73 of XLA), with
    # what `lm-train dpo` asks of a config: pairs and the model's tokenizer (neither read to plan).
    pairs = ["--data.builtin", "null", "--data.train_urls", '["pairs.jsonl"]', "--data.tokenizer", "tokenizer.json"]
    run = json.loads(plan("--json", "--vocab-size", "512").output)
    dpo = json.loads(plan("--json", "--compile", "--dpo", *pairs, "--vocab-size", "512").output)
    assert (run["kind"], dpo["kind"]) == ("lm-train run", "lm-train dpo")
    assert dpo["batch_fields"] == ["input_ids", "loss_mask", "rejected_input_ids", "rejected_loss_mask"]
    assert dpo["reference_bytes"] == dpo["parameters_bytes"] and run["reference_bytes"] == 0  # f32 compute here
    assert dpo["tokens_per_step"] == 2 * run["tokens_per_step"]
    assert dpo["peak_bytes_per_device"] > 1.5 * run["peak_bytes_per_device"]  # XLA's is 1.94x here
    assert abs(dpo["estimate_over_xla"] - 1) < 0.15
    gpu = json.loads(plan("--json", "--dpo", "--devices", "8xH100", "--trainer.mp", "auto", *TINY, *pairs).output)
    assert gpu["reference_bytes"] * 2 == gpu["parameters_bytes"]  # bf16 beside f32, sharded alike
    assert "reference model" in plan("--dpo", *TINY, *pairs).output
    # A config that `lm-train dpo` refuses is refused here too, with its reason.
    for refused, needles in [
        (plan("--dpo", *TINY), ("data.train_urls", "preference pairs")),
        (plan("--dpo", *TINY, *pairs, "--z_loss_weight", "0.1"), ("z_loss_weight", "remove it")),
    ]:
        assert refused.exit_code == 2 and "Traceback" not in refused.output
        assert all(needle in refused.output for needle in needles), refused.output


def test_doremi_plans_domain_ids_and_the_frozen_reference_model_from_the_table_of_kinds(tmp_path):
    """--doremi, a flag the table of kinds gives `lm-train plan`, plans `lm-train doremi`'s step: one domain id per
    example beside the ids, the domain weights, and a frozen reference model; within 15% of XLA's peak for it."""
    mixture = ["--data.builtin", "null", "--data.configs", "{a: {train_urls: [a.jsonl]}, b: {train_urls: [b.jsonl]}}"]
    with_reference = [*mixture, "--doremi.reference_model_path", str(tmp_path)]  # checked to exist, not read
    run = json.loads(plan("--json", *mixture, "--vocab-size", "512").output)
    doremi = json.loads(plan("--json", "--compile", "--doremi", *with_reference, "--vocab-size", "512").output)
    assert (run["kind"], doremi["kind"]) == ("lm-train run", "lm-train doremi")
    assert (run["batch_fields"], doremi["batch_fields"]) == (["input_ids"], ["input_ids", "source_ids"])
    # source_ids holds one int32 per example, not per position.
    assert doremi["batch_bytes"] == run["batch_bytes"] + 4 * doremi["estimate"]["local_batch"]
    assert doremi["reference_bytes"] == doremi["parameters_bytes"] and run["reference_bytes"] == 0  # f32 compute
    assert doremi["tokens_per_step"] == run["tokens_per_step"]
    assert doremi["model_flops_per_step"] == pytest.approx(run["model_flops_per_step"] * 4 / 3)
    assert abs(doremi["estimate_over_xla"] - 1) < 0.15
    assert "reference model" in plan("--doremi", *TINY, *with_reference).output
    # A config that `lm-train doremi` refuses is refused here too, with its reason; one kind per plan.
    for refused, needles in [
        (plan("--doremi", *TINY, *mixture), ("--reference CHECKPOINT", "doremi.reference_model_path")),
        (plan("--doremi", "--dpo", *TINY, *with_reference), ("--dpo and --doremi", "one kind")),
    ]:
        assert refused.exit_code == 2 and "Traceback" not in refused.output
        assert all(needle in refused.output for needle in needles), refused.output
