"""`lm-train run` from a Hugging Face directory whose config names only what changes: the rest comes from its
config.json, and the weights load (a shorter context than the checkpoint's, the common case)."""

from __future__ import annotations

import jax
import pytest
import yaml

import hf_bridge
import named_tensors as nt
from lm_models import Gpt2Config

pytestmark = pytest.mark.slow


def test_a_model_section_with_only_seq_len_trains_from_the_checkpoint(tiny_project, cli):
    base = Gpt2Config(seq_len=64, hidden_dim=48, num_layers=3, num_heads=4, gradient_checkpointing=False)
    model = base.build(nt.Axis("vocab", 384), key=jax.random.key(3))
    hf_dir = tiny_project.root / "hf-base"
    hf_bridge.save_pretrained(model, base, hf_dir, tokenizer=str(tiny_project.root / "tokenizer.json"))
    text = tiny_project.config.read_text(encoding="utf-8")
    start = text.index("model:\n")
    end = text.index("trainer:\n")
    config = tiny_project.write_config(
        "from_hf.yaml", f"{text[:start]}model:\n  seq_len: 16\ninitialize_from_hf: {hf_dir}\n{text[end:]}"
    )
    args = ["run", str(config), "--trainer.run_dir", "runs/from-hf-seq16", "--trainer.num_train_steps", "2"]
    result = cli(args, tiny_project.root)
    assert result.returncode == 0, result.output[-5000:]
    assert f"initialized the model from {hf_dir}" in result.output
    resolved = yaml.safe_load((tiny_project.root / "runs" / "from-hf-seq16" / "config.yaml").read_text())["model"]
    assert resolved["type"] == "gpt2" and resolved["seq_len"] == 16
    assert (resolved["hidden_dim"], resolved["num_layers"], resolved["num_heads"]) == (48, 3, 4)
