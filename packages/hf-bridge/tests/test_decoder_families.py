"""Mistral, Mixtral, Qwen 2/3, Qwen3-MoE, Gemma 1/2/3, OLMo 2, gpt-oss, DeepSeek-V3 and Llama 4 against
transformers, one tiny odd-sized model each (two for DeepSeek-V3's two attention and routing shapes).

Each family: a random transformers model (norms and biases perturbed) imports with the same logits; greedy
decoding with our KV cache gives transformers.generate's tokens; a random model of ours, with the other choice
of tied embeddings where the family allows both, exports to a checkpoint AutoModelForCausalLM loads with our
logits. Sliding windows are shorter than the sequences, the mixtures have more experts than they route to, and the
rope scalings (linear, dynamic, yarn, llama3) are spread over the families.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_bridge
import lm_models
import named_tensors as nt

LENGTH = 13  # every window below is shorter
PROMPT, NEW = 5, 8
SMALL = dict(
    vocab_size=53,
    hidden_size=24,
    intermediate_size=30,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    attn_implementation="eager",
)
LINEAR = {"rope_type": "linear", "factor": 2.0}

# family -> (our type, a transformers config, whether the family can untie its head)
FAMILIES = {
    "mistral": ("mistral", lambda T: T.MistralConfig(**SMALL, sliding_window=5, head_dim=10, rope_scaling=LINEAR)),
    "mixtral": (
        "mixtral",
        lambda T: T.MixtralConfig(
            # transformers' default grouped matmul needs 16-byte strides, which odd sizes do not have.
            **SMALL, experts_implementation="eager", num_local_experts=5, num_experts_per_tok=2, sliding_window=6,
            rope_theta=1e4,
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8},
        ),
    ),
    "qwen2": (
        "qwen2",
        lambda T: T.Qwen2Config(
            **SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=1, tie_word_embeddings=True,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
        ),
    ),
    "qwen3": ("qwen3", lambda T: T.Qwen3Config(**SMALL, head_dim=10, attention_bias=True)),
    "gemma": ("gemma", lambda T: T.GemmaConfig(**SMALL, head_dim=10, attention_bias=True)),
    "gemma2": (
        "gemma2",
        lambda T: T.Gemma2Config(
            **SMALL, head_dim=8, sliding_window=4, query_pre_attn_scalar=12, attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3": (
        "gemma3",
        lambda T: T.Gemma3TextConfig(
            **SMALL, head_dim=8, sliding_window=4, sliding_window_pattern=2, rope_theta=5000.0,
            rope_local_base_freq=300.0, rope_scaling=LINEAR, tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        lambda T: T.Qwen3MoeConfig(
            # Layers 0 and 2 dense (decoder_sparse_step, mlp_only_layers), layer 1 routes to 3 of 5 experts whose
            # probabilities are not renormalised.
            **{**SMALL, "num_hidden_layers": 3}, experts_implementation="eager", head_dim=10, moe_intermediate_size=14,
            num_experts=5, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[2],
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
        ),
    ),
    "gpt_oss": (
        "gpt_oss",
        lambda T: T.GptOssConfig(
            # Sinks, sliding (4) and full layers, 3 of 5 biased experts whose clamp (0.3) the random weights reach.
            **{**SMALL, "intermediate_size": 14}, experts_implementation="eager", head_dim=10, num_local_experts=5,
            num_experts_per_tok=3, sliding_window=4, swiglu_limit=0.3,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "truncate": False,
                             "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0},
        ),
    ),
    "deepseek_v3": (
        "deepseek_v3",
        lambda T: T.DeepseekV3Config(
            # Latent attention (a query rank, interleaved rope features, yarn with mscale_all_dim, which scales the
            # scores); layer 0 dense, then 3 of 6 experts from the 2 best of 3 groups plus 2 shared experts.
            **{**SMALL, "num_hidden_layers": 3, "num_key_value_heads": 4}, experts_implementation="eager",
            q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
            moe_intermediate_size=14, n_routed_experts=6, num_experts_per_tok=3, n_group=3, topk_group=2,
            n_shared_experts=2, routed_scaling_factor=1.7, first_k_dense_replace=1,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "mscale": 1.0,
                             "mscale_all_dim": 0.8, "original_max_position_embeddings": 8},
        ),
    ),
    "deepseek_v3_plain": (
        "deepseek_v3",
        lambda T: T.DeepseekV3Config(
            # One q_proj, attention biases, rope features in halves, every layer sparse (one scan), weights not
            # renormalised, one group.
            **{**SMALL, "num_key_value_heads": 4}, experts_implementation="eager", q_lora_rank=None,
            kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=6, v_head_dim=7, attention_bias=True,
            rope_interleave=False, moe_intermediate_size=10, n_routed_experts=5, num_experts_per_tok=3, n_group=1,
            topk_group=1, norm_topk_prob=False, first_k_dense_replace=0,
        ),
    ),
    "llama4": (
        "llama4",
        lambda T: T.Llama4TextConfig(
            # 6 query heads in groups of 3; layer 2 NoPE (global, temperature-tuned from position 3 on), the others
            # chunked (4 < LENGTH and < PROMPT + NEW) with interleaved rope and the L2 qk-norm; layers 1 and 3 route
            # to 2 of 3 experts plus the shared one, layers 0 and 2 dense of another width; llama3 rope with equal
            # low and high frequency factors, as Llama 4 Scout's.
            **{**SMALL, "num_hidden_layers": 4, "num_attention_heads": 6, "intermediate_size": 14},
            experts_implementation="eager", head_dim=8, intermediate_size_mlp=20, num_local_experts=3,
            num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1], attention_chunk_size=4,
            floor_scale=4, attn_scale=1.5,
            rope_parameters={"rope_type": "llama3", "rope_theta": 1000.0, "factor": 4.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 1.0, "original_max_position_embeddings": 8},
        ),
    ),
    "olmo2": (
        "olmo2",
        lambda T: T.Olmo2Config(
            **{**SMALL, "max_position_embeddings": 8}, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
        ),
    ),
}  # fmt: skip
EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}


def _named(ids: np.ndarray) -> nt.NamedArray:
    return nt.named(jnp.asarray(ids, jnp.int32), ("batch", "position"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers_both_ways_and_in_greedy_decoding(
    hf, parity, ids_for, make_model, tmp_path, family
):
    our_type, make_config = FAMILIES[family]
    hf_config = make_config(hf.transformers)
    theirs = parity.random_hf_model(hf, hf_config)
    theirs.save_pretrained(tmp_path / "hf")
    ids = ids_for(hf_config.vocab_size, LENGTH)
    expected = parity.hf_logits(hf, theirs, ids)

    model, config = hf_bridge.load_pretrained(tmp_path / "hf")
    assert config.model_type == our_type and config.tie_word_embeddings == hf_config.tie_word_embeddings
    parity.assert_close(parity.our_logits(model, ids), expected)

    prompt = ids[:, :PROMPT]
    theirs.generation_config.eos_token_id = None  # ours has no end-of-sequence token: never stop early
    with hf.torch.no_grad():
        reference = theirs.generate(
            hf.torch.tensor(prompt),
            attention_mask=hf.torch.ones(prompt.shape, dtype=hf.torch.long),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        ).numpy()
    ours = lm_models.generate(model, _named(prompt), NEW, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(nt.permute(ours, ("batch", "position")).array), reference)

    other = dataclasses.replace(config, tie_word_embeddings=not config.tie_word_embeddings)
    mine = make_model(other, hf_config.vocab_size, seed=1)
    hf_bridge.save_pretrained(mine, other, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["model_type"] == hf_config.model_type and written["tie_word_embeddings"] == other.tie_word_embeddings
    back = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", **EAGER).eval()
    parity.assert_close(parity.hf_logits(hf, back, ids), parity.our_logits(mine, ids))


MOE_ROUND_TRIPS = {
    # Every layer sparse (one scan), and dense layers mixed in (unrolled); the experts in transformers' on-disk
    # layout: one gate_proj/up_proj/down_proj per expert, the router as mlp.gate.
    "qwen3_moe": lm_models.Qwen3MoeConfig(
        seq_len=8, hidden_dim=16, intermediate_dim=12, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
        moe_intermediate_dim=6, n_routed_experts=3, num_experts_per_tok=2,
    ),
    "qwen3_moe_mixed": lm_models.Qwen3MoeConfig(
        seq_len=8, hidden_dim=16, intermediate_dim=12, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8,
        moe_intermediate_dim=6, n_routed_experts=3, num_experts_per_tok=2, mlp_only_layers=(0,), scan_layers=False,
    ),
    # Biases on the router and experts, gate and up interleaved in one gate_up_proj (experts, embed, 2 * mlp).
    "gpt_oss": lm_models.GptOssConfig(
        seq_len=8, hidden_dim=16, intermediate_dim=6, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
        n_routed_experts=3, num_experts_per_tok=2, sliding_window=4,
    ),
    # Latent attention (kv_a_proj_with_mqa holds the latent's and the rope key's projections), a dense layer 0,
    # then routed experts one per key, the router with its correction bias, and the shared experts.
    "deepseek_v3": lm_models.DeepseekV3Config(
        seq_len=8, hidden_dim=16, intermediate_dim=12, num_layers=2, num_heads=2, q_lora_rank=6, kv_lora_rank=5,
        qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3, attention_bias=True, moe_intermediate_dim=6,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        scan_layers=False,
    ),
    # Every layer sparse (one scan) with a NoPE layer among the chunked ones: the router, the experts fused as
    # transformers stores them (gate then up in gate_up_proj, laid out (experts, embed, 2 * mlp)), the shared one.
    "llama4": lm_models.Llama4Config(
        seq_len=8, hidden_dim=16, intermediate_dim=12, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
        moe_intermediate_dim=6, n_routed_experts=3, num_experts_per_tok=2, no_rope_layer_interval=2,
        attention_chunk_size=4,
    ),
    # Dense layer 0 and sparse layer 1 (unrolled).
    "llama4_mixed": lm_models.Llama4Config(
        seq_len=8, hidden_dim=16, intermediate_dim=12, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
        moe_intermediate_dim=6, n_routed_experts=3, num_experts_per_tok=1, interleave_moe_layer_step=2,
        attention_chunk_size=4, scan_layers=False,
    ),
}  # fmt: skip
MOE_KEYS = {
    "qwen3_moe": ["model.layers.1.mlp.experts.2.down_proj.weight", "model.layers.0.mlp.gate.weight"],
    "qwen3_moe_mixed": ["model.layers.0.mlp.up_proj.weight", "model.layers.2.mlp.experts.0.gate_proj.weight"],
    "gpt_oss": ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.self_attn.sinks"],
    "deepseek_v3": [
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.bias",
        "model.layers.1.self_attn.q_a_layernorm.weight",
    ],
    "llama4": [
        "model.layers.1.feed_forward.experts.gate_up_proj",
        "model.layers.0.feed_forward.experts.down_proj",
        "model.layers.1.feed_forward.router.weight",
        "model.layers.0.feed_forward.shared_expert.down_proj.weight",
    ],
    "llama4_mixed": ["model.layers.0.feed_forward.up_proj.weight", "model.layers.1.feed_forward.experts.down_proj"],
}
NOT_KEYS = {
    "qwen3_moe": ["model.layers.0.mlp.up_proj.weight"],
    "qwen3_moe_mixed": ["model.layers.0.mlp.gate.weight"],
    "gpt_oss": ["model.layers.0.mlp.experts.0.gate_proj.weight"],
    "deepseek_v3": ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.up_proj.weight"],
    "llama4": ["model.layers.0.feed_forward.up_proj.weight", "model.layers.0.self_attn.q_norm.weight"],
    "llama4_mixed": ["model.layers.0.feed_forward.router.weight", "model.layers.1.feed_forward.gate_proj.weight"],
}


@pytest.mark.parametrize("name", list(MOE_ROUND_TRIPS))
def test_moe_checkpoints_round_trip_bit_for_bit_in_transformers_layout(make_model, tmp_path, name):
    from safetensors.numpy import load_file

    config = MOE_ROUND_TRIPS[name]
    model = make_model(config, 29)
    hf_bridge.save_pretrained(model, config, tmp_path / "hf", max_shard_size=2000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {k: v for f in sorted(set(index.values())) for k, v in load_file(tmp_path / "hf" / f).items()}
    assert all(k in tensors for k in MOE_KEYS[name]) and not any(k in tensors for k in NOT_KEYS[name])
    if name == "gpt_oss":  # interleaved: gate_up_proj[..., 2j] is gate unit j, [..., 2j + 1] up unit j
        experts = model.blocks.stacked.mlp.experts
        fused = tensors["model.layers.1.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(fused[..., 0::2], np.asarray(experts.gate.array[1]).transpose(0, 2, 1))
        np.testing.assert_array_equal(fused[..., 1::2], np.asarray(experts.up.array[1]).transpose(0, 2, 1))
    if name == "deepseek_v3":  # the latent's 5 rows, then the rope key's 2
        attn = model.blocks.blocks[1].self_attn
        fused = tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
        np.testing.assert_array_equal(fused[:5], np.asarray(attn.kv_a_proj.weight.array))
        np.testing.assert_array_equal(fused[5:], np.asarray(attn.k_rope_proj.weight.array))
    if name == "llama4":  # gate_up_proj[..., :mlp] is the gate, [..., mlp:] the up projection, (in, out) per expert
        experts = model.blocks.stacked.mlp.experts
        fused = tensors["model.layers.1.feed_forward.experts.gate_up_proj"]
        np.testing.assert_array_equal(fused[..., :6], np.asarray(experts.gate.array[1]).transpose(0, 2, 1))
        np.testing.assert_array_equal(fused[..., 6:], np.asarray(experts.up.array[1]).transpose(0, 2, 1))
    loaded, loaded_config = hf_bridge.load_pretrained(tmp_path / "hf")
    assert loaded_config == config
    for ours, theirs in zip(jax.tree.leaves(model), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
