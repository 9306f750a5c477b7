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


# The keys of the configs published with well-known checkpoints (values shrunk where they set sizes).
PUBLISHED = {
    "gpt2": {
        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
        "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
        "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None,
        "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
        "summary_use_proj": True, "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "vocab_size": 50257,
    },
    "llama-3.1": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
    },
    "mpt-7b": {
        "architectures": ["MPTForCausalLM"],
        "attn_config": {"alibi": True, "alibi_bias_max": 8, "attn_impl": "torch", "attn_pdrop": 0,
                        "attn_type": "multihead_attention", "attn_uses_sequence_id": False, "clip_qkv": None,
                        "prefix_lm": False, "qk_ln": False, "softmax_scale": None},
        "auto_map": {"AutoConfig": "configuration_mpt.MPTConfig"}, "d_model": 4096, "emb_pdrop": 0,
        "embedding_fraction": 1.0, "expansion_ratio": 4, "init_config": {"name": "kaiming_normal_"},
        "init_device": "cpu", "learned_pos_emb": True, "logit_scale": None, "max_seq_len": 2048,
        "model_type": "mpt", "n_heads": 32, "n_layers": 32, "no_bias": True, "norm_type": "low_precision_layernorm",
        "resid_pdrop": 0, "tokenizer_name": "EleutherAI/gpt-neox-20b", "torch_dtype": "bfloat16",
        "transformers_version": "4.28.1", "use_cache": False, "verbose": 0, "vocab_size": 50432,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_convert(name):
    ours = hf_config_to_ours(PUBLISHED[name])
    assert ours.hidden_dim == PUBLISHED[name].get("n_embd", PUBLISHED[name].get("hidden_size", 4096))
    if name == "llama-3.1":
        assert ours.rope == RopeConfig(type="llama3", theta=500000.0, factor=8.0)
        assert ours.num_kv_heads == 8 and not ours.tie_word_embeddings
