"""Levanter keys: renamed onto ours, accepted with a note, or refused by the feature they ask for; all documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from lm_train.config import load_train_config
from lm_train.config.levanter_translation import levanter_paths
from lm_train.errors import ConfigError

DOCS = Path(__file__).parents[3] / "docs" / "configuration.md"
DATA = "data:\n  train_urls: [train.jsonl]\n  tokenizer: tokenizer.json\n"


def _load(tmp_path: Path, text: str):
    path = tmp_path / "levanter.yaml"
    path.write_text(DATA + text, encoding="utf-8")
    return load_train_config([path])[0]


def test_legacy_wandb_section_is_the_wandb_tracker(tmp_path):
    config = _load(tmp_path, "trainer:\n  wandb:\n    project: p\n    tags: [a, b]\n")
    (tracker,) = config.trainer.tracker
    assert tracker.to_dict()["type"] == "wandb"
    assert tracker.to_dict()["project"] == "p" and list(tracker.to_dict()["tags"]) == ["a", "b"]
    with pytest.raises(ConfigError, match="both given"):
        _load(tmp_path, "trainer:\n  wandb: {project: p}\n  tracker: {type: jsonl}\n")


def test_renamed_internal_and_missing_keys(tmp_path, capsys):
    config = _load(tmp_path, "optimizer:\n  warmup_ratio: 0.2\ntrainer:\n  jax_compilation_cache_dir: jc\n")
    assert config.optimizer.warmup == 0.2 and config.trainer.compilation_cache_dir == "jc"

    _load(tmp_path, "trainer:\n  log_dir: logs\n")
    assert "`trainer.log_dir` is accepted and ignored" in capsys.readouterr().err
    config = _load(tmp_path, "trainer:\n  ray: {auto_start_cluster: false, address: null}\n")  # a key of ours too
    assert config.trainer.ray.auto_start_cluster is False and "trainer.ray" not in capsys.readouterr().err

    _load(tmp_path, "optimizer:\n  nesterov: false\n")  # Levanter's "off" is accepted quietly
    with pytest.raises(ConfigError, match=r"levanter\.yaml:\d+: `optimizer.nesterov: True` asks for Nesterov"):
        _load(tmp_path, "optimizer:\n  nesterov: true\n")

    config = _load(tmp_path, "model:\n  hidden_dim: 48\n")
    assert config.model.model_type == "gpt2"


def test_every_handled_levanter_key_is_documented():
    text = DOCS.read_text(encoding="utf-8")
    missing = [".".join(p) for p in levanter_paths() if f"`{'.'.join(p)}`" not in text]
    assert not missing


def test_use_hf_model_config_takes_the_checkpoint_model_and_true_asks_for_a_directory(tmp_path):
    import json

    from lm_train.run.preflight import _check_hf_source, with_hf_model_config

    (tmp_path / "hf").mkdir()  # a Hugging Face GPT-2 config.json, in transformers' own key names
    hf = {"model_type": "gpt2", "n_embd": 48, "n_head": 4, "n_layer": 3, "n_positions": 64, "vocab_size": 40}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf), encoding="utf-8")

    config = _load(
        tmp_path, f"model: {{type: gpt2}}\ninitialize_from_hf: {tmp_path / 'hf'}\nuse_hf_model_config: true\n"
    )
    taken = with_hf_model_config(config).model
    assert (taken.hidden_dim, taken.num_heads, taken.num_layers, taken.seq_len) == (48, 4, 3, 64)
    assert with_hf_model_config(_load(tmp_path, "model: {type: gpt2}\n")).model.hidden_dim != 48

    with pytest.raises(ConfigError, match="downloads nothing from the hub"):
        _check_hf_source(_load(tmp_path, "initialize_from_hf: true\n"))


def test_levanter_recipe_keys_resolve_with_their_meaning(tmp_path):
    """The shapes of Levanter's EMA, skip-step and cyclic-schedule configs resolve unchanged (our own files)."""
    from lm_train.config.optimizer_config import SkipStepConfig
    from lm_train.optim import learning_rate_schedule

    config = _load(
        tmp_path,
        "trainer:\n  num_train_steps: 20000\n  model_averaging:\n    type: ema\n    beta: 0.995\n"
        "optimizer:\n  learning_rate: 1E-3\n  warmup: 0.01\n  decay: 200\n  lr_schedule: inv\n"
        "  skip_bad_steps: true\n  rewarmup: 0.0\n  cycles: null\n  cycle_length: 10000\n",
    )
    assert config.trainer.model_averaging.beta == 0.995
    assert config.optimizer.skip_steps == SkipStepConfig(rolling_interval_length=128, sigma_factor=6.0)
    schedule = learning_rate_schedule(config.optimizer, config.trainer.num_train_steps)
    # Two cycles of 10000: warm-up over 100 steps, the peak held, `inv` decay over each cycle's last 200 steps.
    assert float(schedule(100)) == pytest.approx(1e-3) and float(schedule(9799)) == pytest.approx(1e-3)
    assert float(schedule(9999)) < 2e-4 and float(schedule(10000)) == pytest.approx(1e-3)
