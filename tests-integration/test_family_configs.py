"""Each family's nano config trains on the built-in corpus from the CLI, briefly, with the loss falling.

The runs are short (12 steps of 8 sequences) and share the session's cache of the built-in corpus, so each costs
about one start-up and one compile; Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3 and Llama 4 also report their
routers' load-balancing loss and their experts' load, and DeepSeek-V3 its balance biases.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

import trackers

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["mistral", "qwen3", "gemma2", "olmo2", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "llama4"]


@pytest.fixture(scope="module")
def configs_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("families")
    shutil.copytree(ROOT / "configs", root / "configs")
    return root


@pytest.mark.parametrize("family", FAMILIES)
def test_nano_config_trains_with_the_loss_falling(family, configs_dir, cli, stdlib_cache_dir):
    args = [
        "run",
        f"configs/{family}_nano.yaml",
        *("--trainer.run_dir", f"runs/{family}", "--trainer.num_train_steps", "12"),
        *("--trainer.train_batch_size", "8", "--trainer.log_every", "4", "--trainer.steps_per_eval", "12"),
        *("--trainer.max_eval_batches", "1", "--data.cache_dir", str(stdlib_cache_dir)),
    ]
    result = cli(args, configs_dir)
    assert result.returncode == 0, result.output[-5000:]
    rows = trackers.read_jsonl(configs_dir / "runs" / family / "metrics.jsonl")
    losses = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert sorted(losses) == [4, 8, 12]
    assert losses[12] < losses[4] - 0.5, losses  # from ln(4096) = 8.3 at the start; 12 steps take well over 0.5 off
    assert any("eval/loss" in r for r in rows)
    if family in ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "llama4"):
        aux = [r["train/router_aux_loss"] for r in rows if "train/router_aux_loss" in r]
        assert len(aux) == 3 and all(a > 0 for a in aux)
        # The routers' load rides in the step's metrics: shares of the routed choices, at every log step.
        logged = [r for r in rows if "router/load_max" in r]
        assert len(logged) == 3
        for r in logged:
            assert 0 <= r["router/load_min"] <= r["router/load_max"] <= 1 and r["router/load_cv"] >= 0
            assert sum(r["router/load_hist"]["counts"]) > 0
        # DeepSeek-V3's nano balances its experts with the correction biases, which move from zero.
        balanced = [r for r in rows if "router/balance_bias_max" in r]
        assert len(balanced) == (3 if family == "deepseek_v3" else 0)
        assert all(r["router/balance_bias_abs_mean"] > 0 for r in balanced)
    if family == "deepseek_v3":  # its multi-token prediction depth trains beside it; the end's export holds it
        mtp = [r["train/mtp_loss"] for r in rows if "train/mtp_loss" in r]
        assert len(mtp) == 3 and mtp[-1] < mtp[0], mtp
        exported = configs_dir / "runs" / family / "hf" / "step-12"
        assert json.loads((exported / "config.json").read_text())["num_nextn_predict_layers"] == 1
        with safe_open(exported / "model.safetensors", "np") as f:
            keys = set(f.keys())
        assert {"model.layers.4.eh_proj.weight", "model.layers.4.mlp.gate.weight"} <= keys
