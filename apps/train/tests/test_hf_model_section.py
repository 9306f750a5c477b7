"""A run from a local Hugging Face directory: the model keys the config leaves out come from its config.json (type
included), and only a key the config writes can disagree with the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hf_bridge
from lm_models import Gpt2Config, LlamaConfig
from lm_train.config import load_train_config
from lm_train.errors import ConfigError
from lm_train.run.preflight import with_hf_model_config

DATA = "data:\n  train_urls: [train.jsonl]\n  tokenizer: tokenizer.json\n"
LLAMA = LlamaConfig(seq_len=64, hidden_dim=48, intermediate_dim=96, num_layers=3, num_heads=4, num_kv_heads=2)


def _hf_dir(root: Path, config) -> Path:
    """A directory holding config.json as transformers writes it for `config` (weights are not read here)."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps(hf_bridge.our_config_to_hf(config, 40)), encoding="utf-8")
    return root


def _load(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()):
    path = tmp_path / "run.yaml"
    path.write_text(DATA + text, encoding="utf-8")
    return load_train_config([path], list(overrides))[0]


def test_use_hf_model_config_without_a_model_section_takes_the_type_from_config_json(tmp_path):
    hf = _hf_dir(tmp_path / "llama", LLAMA)
    config = with_hf_model_config(_load(tmp_path, f"initialize_from_hf: {hf}\nuse_hf_model_config: true\n"))
    assert config.model == LLAMA  # not "the model section asks for type 'gpt2'"


def test_a_model_section_with_only_seq_len_keeps_it_and_takes_the_rest_from_config_json(tmp_path):
    hf = _hf_dir(tmp_path / "llama", LLAMA)
    for extra in ("", "use_hf_model_config: true\n"):
        config = with_hf_model_config(_load(tmp_path, f"initialize_from_hf: {hf}\n{extra}model:\n  seq_len: 16\n"))
        assert config.model == LlamaConfig(**{**LLAMA.__dict__, "seq_len": 16}), extra
    # A flag counts as written too, and keys that only change how the model runs may be written freely.
    config = _load(tmp_path, f"initialize_from_hf: {hf}\n", ("--model.gradient_checkpointing", "false"))
    assert config.model == LlamaConfig(**{**LLAMA.__dict__, "gradient_checkpointing": False})
    # Without initialize_from_hf nothing is read: the model section's own defaults stand.
    assert _load(tmp_path, "model:\n  seq_len: 16\n").model == Gpt2Config(seq_len=16)


def test_only_a_written_key_can_conflict_and_it_is_named_by_line(tmp_path):
    hf = _hf_dir(tmp_path / "gpt2", Gpt2Config(seq_len=64, hidden_dim=48, num_layers=3, num_heads=4))
    text = f"initialize_from_hf: {hf}\nmodel:\n  seq_len: 32\n  hidden_dim: 4096\n"
    with pytest.raises(ConfigError, match=r"run\.yaml:7: .*config\.json gives hidden_dim=48 but the model section has"):
        _load(tmp_path, text)
    with pytest.raises(ConfigError, match=r"--model\.num_layers: .*gives num_layers=3 but the model section has num_"):
        _load(tmp_path, f"initialize_from_hf: {hf}\n", ("--model.num_layers", "12"))
    with pytest.raises(ConfigError, match=r"run\.yaml:6: model.type is 'llama', but .* describes a gpt2 model"):
        _load(tmp_path, f"initialize_from_hf: {hf}\nmodel:\n  type: llama\n")
