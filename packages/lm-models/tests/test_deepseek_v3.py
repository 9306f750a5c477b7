"""DeepSeek-V3 without torch: its decoding cache holds latents only, and configs it cannot run are refused with the
key to change (its logits against transformers are in hf-bridge's parity tests)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import lm_models as lm
import named_tensors as nt

SMALL = dict(
    seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=3, num_heads=4, q_lora_rank=8, kv_lora_rank=6,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=5, moe_intermediate_dim=8, n_routed_experts=6,
    num_experts_per_tok=3, n_group=3, topk_group=2, first_k_dense_replace=1,
)  # fmt: skip


def test_the_decoding_cache_holds_one_latent_and_one_rope_key_per_position_and_layer():
    config = lm.DeepseekV3Config(**SMALL)
    model = eqx.filter_eval_shape(lambda: config.build(nt.Axis("vocab", 20), key=jax.random.key(0)))
    batch = (nt.Axis("batch", 2),)
    cache = eqx.filter_eval_shape(lambda: model.init_cache(batch, 10, jnp.float32))
    assert dict(zip(cache.latent.axis_names, cache.latent.array.shape, strict=True)) == {
        "layers": 3, "batch": 2, "key_position": 10, "kv_lora": 6,
    }  # fmt: skip
    assert dict(zip(cache.rope_key.axis_names, cache.rope_key.array.shape, strict=True)) == {
        "layers": 3, "batch": 2, "key_position": 10, "qk_rope": 4,
    }  # fmt: skip
    # Per position and layer: 6 + 4 numbers, where per-head keys and values would take 4 * ((8 + 4) + 5) = 68.
    per_position = sum(leaf.size for leaf in jax.tree.leaves(cache)) / (3 * 2 * 10)
    assert per_position == 6 + 4
    assert not lm.supports_paging(model)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_kv_heads": 2}, r"num_kv_heads is 4 here .*leave it out"),
        ({"head_dim": 8}, r"head_dim is 4 here"),
        ({"n_group": 4}, r"n_routed_experts=6 must split into n_group=4 equal groups"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 exceeds the 4 experts"),
        ({"attn_backend": "jax_flash"}, r"plain attention kernel only"),
        ({"first_k_dense_replace": 4}, r"first_k_dense_replace must be between 0 and num_layers=3"),
        ({"scan_layers": True}, r"layers \[0\] have a dense MLP.*set scan_layers: false"),
        ({"lbl_coef": -1.0}, r"lbl_coef must be >= 0"),
    ],
)
def test_configs_it_cannot_run_are_refused_naming_the_key(change, message):
    with pytest.raises(ValueError, match=message):
        lm.DeepseekV3Config(**{**SMALL, **change})


def test_every_layer_sparse_runs_as_one_scan():
    config = lm.DeepseekV3Config(**{**SMALL, "first_k_dense_replace": 0, "scan_layers": True})
    model = eqx.filter_eval_shape(lambda: config.build(nt.Axis("vocab", 20), key=jax.random.key(0)))
    assert isinstance(model.blocks, nt.Stacked)
    assert model.blocks.stacked.mlp.correction_bias.axis_names == ("layers", "experts")
