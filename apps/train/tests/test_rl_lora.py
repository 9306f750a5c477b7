"""LoRA with `lm-train rl`, without training: the plan keeps no reference copy, and the refused settings through the
CLI (exit 2, the key and the fix named, no traceback, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lm_train.cli import app

VOCAB, SEQ, HIDDEN, LAYERS = 64, 16, 32, 2
CONFIG = f"""\
data:
  train_urls: ["prompts.jsonl"]
  tokenizer: tokenizer.json
initialize_from_hf: base
model: {{type: gpt2, seq_len: {SEQ}, hidden_dim: {HIDDEN}, num_heads: 2, num_layers: {LAYERS}}}
rl:
  group_size: 4
  prompts_per_step: 2
  max_new_tokens: 4
  rewards: [{{fn: "lm_train.post.rl.rewards:exact_answer"}}]
trainer: {{seed: 0, mp: f32, num_train_steps: 2, train_batch_size: 8, run_dir: runs/rl}}
"""
LORA = ["--lora", "{r: 4, alpha: 8.0}"]


def gpt2_parameters(vocab: int, positions: int, hidden: int, layers: int) -> int:
    """GPT-2's parameter count, by its architecture (tied embeddings; per layer two layer norms, the fused qkv and
    output projections and the 4x MLP, each with a bias), independent of the planner."""
    per_layer = 2 * 2 * hidden + (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden)
    per_layer += (hidden * 4 * hidden + 4 * hidden) + (4 * hidden * hidden + hidden)
    return vocab * hidden + positions * hidden + layers * per_layer + 2 * hidden


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    (tmp_path / "rl.yaml").write_text(CONFIG, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_plan_of_rl_with_lora_counts_no_reference_copy(project):
    """Without LoRA the plan keeps a reference model beside the state, one copy of the parameters in the f32 compute
    dtype; with LoRA the reference is the base under the adapters, so the step's arguments hold no such copy."""
    plans = {}
    for name, extra in (("full", []), ("lora", LORA)):
        args = ["plan", "rl.yaml", "--rl", "--json", "--devices", "cpu:1", "--vocab-size", str(VOCAB), *extra]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        plans[name] = json.loads(result.output)
    full, lora = plans["full"], plans["lora"]
    count = gpt2_parameters(VOCAB, SEQ, HIDDEN, LAYERS)
    assert full["parameter_count"] == count and full["parameters_bytes"] == 4 * count
    assert full["reference_bytes"] == 4 * count  # one copy of the parameters, f32
    assert lora["reference_bytes"] == 0 and any("no reference model is kept" in n for n in lora["notes"])
    assert lora["parameter_count"] > count and 0 < lora["gradients_bytes"] < full["gradients_bytes"] / 4  # adapters

    def unexplained(plan: dict) -> int:
        """The step's argument bytes that the plan's breakdown does not name (its step counter, keys, ...)."""
        named = ("parameters_bytes", "optimizer_state_bytes", "batch_bytes", "reference_bytes")
        return plan["estimate"]["argument_bytes"] - sum(plan[key] for key in named)

    # The step's arguments are the breakdown's lines: a reference model copy without LoRA, none with it.
    assert unexplained(full) == unexplained(lora) and 0 <= unexplained(lora) < 64


REFUSED = {
    "dropout": (["--lora", "{r: 4, alpha: 8.0, dropout: 0.1}"], ("lora.dropout is 0.1", "set lora.dropout to 0")),
    "reference": (
        [*LORA, "--rl.reference_model_path", "reference"],
        ("rl.reference_model_path", "remove rl.reference_model_path, or the lora section"),
    ),
    "no_base": ([*LORA, "--initialize_from_hf", "null"], ("lora:", "set initialize_from_hf to the model's")),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_lora_settings_rl_refuses_are_clear_cli_errors(project, case):
    """`lm-train rl` and `lm-train plan --rl` refuse them in the kind's config check, before jax starts a run."""
    overrides, needles = REFUSED[case]
    for command in (["rl", "rl.yaml"], ["plan", "rl.yaml", "--rl", "--vocab-size", str(VOCAB)]):
        result = CliRunner().invoke(app, [*command, *overrides])
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        assert "Traceback" not in result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, result.output
        assert all(needle in result.output for needle in needles), result.output
        assert sorted(p.name for p in project.iterdir()) == ["rl.yaml"]  # refused before anything is written
