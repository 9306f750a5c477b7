"""The config mapping both ways: ours -> config.json -> ours is the identity on everything HF can say."""

import pytest

from hf_bridge import HfBridgeError, hf_config_to_ours, our_config_to_hf
from lm_models import BackpackConfig, Gpt2Config, LlamaConfig, MptConfig, RopeConfig

CONFIGS = [
    Gpt2Config(seq_len=33, hidden_dim=30, num_layers=3, num_heads=5, mlp_scale=3, activation_function="gelu",
               layer_norm_epsilon=1e-6, scale_attn_by_inverse_layer_idx=True, resid_pdrop=0.1, upcast_attn=True),
    LlamaConfig(seq_len=64, hidden_dim=48, intermediate_dim=100, num_layers=2, num_heads=6, num_kv_heads=2,
                tie_word_embeddings=True, use_bias=True, layer_norm_epsilon=1e-6,
                rope=RopeConfig(type="llama3", theta=5e5, factor=8.0, original_max_position_embeddings=32)),
    LlamaConfig(hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=4, num_kv_heads=4,
                rope=RopeConfig(type="linear", factor=4.0)),
    MptConfig(seq_len=20, hidden_dim=24, num_layers=2, num_heads=3, clip_qkv=6.0, resid_pdrop=0.1, embed_pdrop=0.2),
    BackpackConfig(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4, num_senses=8, sense_intermediate_scale=2,
                   use_bias=False),
]  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.model_type)
def test_round_trip_through_config_json(config):
    hf = our_config_to_hf(config, 77)
    assert hf["vocab_size"] == 77 and hf["architectures"]
    assert hf_config_to_ours(hf) == config


def test_overrides_set_fields_hf_has_no_word_for():
    hf = our_config_to_hf(CONFIGS[0], 10)
    ours = hf_config_to_ours(hf, scan_layers=False, gradient_checkpointing="nested")
    assert (ours.scan_layers, ours.gradient_checkpointing) == (False, "nested")
    with pytest.raises(HfBridgeError, match="no field"):
        hf_config_to_ours(hf, not_a_field=1)


def test_configs_load_in_transformers(hf):
    for config in CONFIGS[:4]:
        hf_dict = our_config_to_hf(config, 50)
        cls = hf.transformers.AutoConfig.for_model(hf_dict["model_type"]).__class__
        loaded = cls.from_dict(hf_dict)
        assert hf_config_to_ours(loaded.to_dict()) == config


def test_mpt_export_writes_no_attention_dropout_for_transformers_5():
    import dataclasses

    config = dataclasses.replace(CONFIGS[3], attn_pdrop=0.1)
    hf = our_config_to_hf(config, 10)
    assert hf["attn_config"]["attn_pdrop"] == 0
    assert hf_config_to_ours(hf) == dataclasses.replace(config, attn_pdrop=0.0)
