"""config.json of the decoder families: round trips, and an error naming the key for what we cannot represent."""

import pytest

import lm_models as lm
from hf_bridge import HfBridgeError, hf_config_to_ours, our_config_to_hf

BASE = dict(seq_len=32, hidden_dim=24, intermediate_dim=30, num_layers=4, num_heads=4, num_kv_heads=2)
YARN = lm.RopeConfig(type="yarn", theta=5e5, factor=4.0, original_max_position_embeddings=8, beta_fast=16.0)
DYNAMIC = lm.RopeConfig(type="dynamic", theta=1e4, factor=2.0, original_max_position_embeddings=32)
OURS = [
    lm.MistralConfig(**BASE, sliding_window=5, head_dim=10, tie_word_embeddings=True),
    lm.MixtralConfig(**BASE, n_routed_experts=6, num_experts_per_tok=3, lbl_coef=0.02, rzl_coef=None, rope=YARN),
    lm.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=6, max_window_layers=2, rope=DYNAMIC),
    lm.Qwen3Config(**BASE, head_dim=8, attention_bias=True),
    lm.GemmaConfig(**BASE, head_dim=8, use_bias=True),
    lm.Gemma2Config(**BASE, head_dim=8, sliding_window=7, sliding_window_pattern=2, query_pre_attn_scalar=10),
    lm.Gemma3Config(**BASE, head_dim=8, sliding_window=7, sliding_window_pattern=3, rope_local_base_freq=50.0),
    lm.Olmo2Config(**BASE, attention_bias=True, rope=YARN),
    lm.Qwen3MoeConfig(
        **BASE,
        head_dim=8,
        moe_intermediate_dim=6,
        n_routed_experts=5,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=(3,),
        sliding_window=5,
        scan_layers=False,
        rope=YARN,
    ),
    lm.GptOssConfig(**BASE, head_dim=8, n_routed_experts=5, num_experts_per_tok=3, sliding_window=5, swiglu_limit=3.0),
    lm.DeepseekV3Config(
        **{**BASE, "num_kv_heads": 4},
        q_lora_rank=None,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        rope_interleave=False,
        attention_bias=True,
        moe_intermediate_dim=6,
        n_routed_experts=6,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=3,
        topk_group=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        first_k_dense_replace=2,
        scan_layers=False,
        lbl_coef=0.003,
        rope=lm.RopeConfig(
            type="yarn", theta=1e4, factor=4.0, original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=1.0
        ),
    ),
    lm.Llama4Config(
        **BASE,
        head_dim=8,
        moe_intermediate_dim=6,
        n_routed_experts=5,
        num_experts_per_tok=3,
        moe_layers=(0, 3),
        nope_layers=(1,),
        attention_chunk_size=6,
        use_qk_norm=False,
        floor_scale=16,
        attn_scale=0.2,
        attention_bias=True,
        scan_layers=False,
        lbl_coef=0.01,
        rope=lm.RopeConfig(
            type="llama3",
            theta=5e5,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=1.0,
            original_max_position_embeddings=16,
        ),
    ),
]


@pytest.mark.parametrize("config", OURS, ids=[c.model_type for c in OURS])
def test_config_round_trips_through_config_json(config):
    hf = our_config_to_hf(config, 97)
    assert hf_config_to_ours(hf) == config


MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "vocab_size": 10,
}
QWEN2 = {**MIXTRAL, "model_type": "qwen2"}
GEMMA2 = {**MIXTRAL, "model_type": "gemma2", "head_dim": 8}
GEMMA3 = {**MIXTRAL, "model_type": "gemma3_text", "head_dim": 8}
GPT_OSS = {**MIXTRAL, "model_type": "gpt_oss", "head_dim": 8, "num_local_experts": 4}
QWEN3_MOE = {**MIXTRAL, "model_type": "qwen3_moe", "moe_intermediate_size": 8, "num_experts_per_tok": 2}
LLAMA4 = {**MIXTRAL, "model_type": "llama4_text", "intermediate_size_mlp": 20, "num_local_experts": 3}
DEEPSEEK_V3 = {
    **MIXTRAL,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 8,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 4,
    "v_head_dim": 4,
    "n_routed_experts": 4,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
}


@pytest.mark.parametrize(
    ("hf", "pattern"),
    [
        ({**MIXTRAL, "model_type": "gemma3"}, r"model_type='gemma3'.*supported: \[.*'gemma3_text'"),
        ({**MIXTRAL, "model_type": "mistral", "attn_logit_softcapping": 30.0}, r"'attn_logit_softcapping'"),
        ({**MIXTRAL, "router_jitter_noise": 0.1}, r"router_jitter_noise=0.1.*jitter"),
        ({**QWEN2, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 2}, r"layer_types=.*max_window"),
        ({**QWEN2, "use_mrope": True}, r"use_mrope"),
        ({**QWEN3_MOE, "num_experts": 4, "num_local_experts": 6}, r"num_local_experts=6: differs from num_experts=4"),
        ({**QWEN3_MOE, "num_experts": 0}, r"num_experts=0: .*convert it as model_type qwen3"),
        ({**DEEPSEEK_V3, "num_key_value_heads": 1}, r"num_key_value_heads=1: must equal num_attention_heads=2"),
        ({**DEEPSEEK_V3, "head_dim": 8}, r"head_dim=8: must equal qk_rope_head_dim=4"),
        ({**DEEPSEEK_V3, "topk_method": "greedy"}, r"topk_method='greedy' is not supported"),
        ({**GPT_OSS, "layer_types": ["full_attention", "sliding_attention"]}, r"layer_types=.*gpt-oss's alternation"),
        ({**GEMMA2, "layer_types": ["full_attention", "sliding_attention"]}, r"layer_types=.*every-n-th"),
        ({**LLAMA4, "layer_types": ["full_attention"] * 2}, r"layer_types=.*no_rope_layers and attention_chunk_size"),
        ({**LLAMA4, "no_rope_layers": [1, 2]}, r"no_rope_layers=\[1, 2\]: must hold a 0 or 1 for each of the 2"),
        ({**GEMMA2, "use_bidirectional_attention": True}, r"use_bidirectional_attention"),
        ({**GEMMA2, "hidden_act": "silu"}, r"hidden_act='silu'.*differs from hidden_activation"),
        (
            {**GEMMA3, "rope_parameters": {"full_attention": {"rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            r"sliding layers' RoPE has type 'linear'",
        ),
        ({**MIXTRAL, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, r"lacks \['original_max_position"),
        (
            {**MIXTRAL, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8,
                                         "long_factor": [1.0]}},
            r"\['long_factor'\]",
        ),
    ],
)  # fmt: skip
def test_what_lm_models_cannot_represent_is_an_error_naming_the_key(hf, pattern):
    with pytest.raises(HfBridgeError, match=pattern):
        hf_config_to_ours(hf)


def test_gemma_layer_patterns_are_recovered_from_layer_types():
    five_one = ["sliding_attention"] * 5 + ["full_attention"]
    config = hf_config_to_ours({**GEMMA3, "num_hidden_layers": 7, "layer_types": [*five_one, "sliding_attention"]})
    assert config.sliding_window_pattern == 6
    every_local = hf_config_to_ours({**GEMMA3, "layer_types": ["sliding_attention"] * 2, "sliding_window": 3})
    assert every_local.decoder_spec().layer_windows == (3, 3)


def test_a_qwen3_moe_with_dense_and_sparse_layers_imports_unrolled():
    config = hf_config_to_ours({**QWEN3_MOE, "decoder_sparse_step": 2, "num_experts": 4})
    assert config.dense_layers() == (0,) and config.scan_layers is False
    assert hf_config_to_ours({**QWEN3_MOE, "num_experts": 4}).scan_layers is True


def test_configs_transformers_cannot_load_are_refused_on_export():
    with pytest.raises(HfBridgeError, match="use_bias=True"):
        our_config_to_hf(lm.MistralConfig(**BASE, use_bias=True), 10)
