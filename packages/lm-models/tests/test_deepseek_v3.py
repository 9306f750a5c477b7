"""DeepSeek-V3 without torch: its decoding cache holds latents only, and configs it cannot run are refused with the
key to change (its logits against transformers are in hf-bridge's parity tests)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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
        ({"bias_update_speed": -0.001}, r"bias_update_speed must be >= 0 \(0 turns it off\)"),
        ({"mtp_depth": 15}, r"mtp_depth=15 leaves no token to predict in seq_len=16"),
        ({"mtp_depth": -1}, r"mtp_depth must be an int >= 0"),
        ({"mtp_loss_weight": -0.1}, r"mtp_loss_weight must be >= 0"),
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


def _rms(x, weight, eps):
    return (
        x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight.reshape((1,) * (x.ndim - 1) + (-1,))
    )


def test_mtp_loss_against_plain_jax_numpy_and_depth_0_leaves_the_program_unchanged():
    mtp = lm.DeepseekV3Config(**{**SMALL, "num_layers": 2}, mtp_depth=2, mtp_loss_weight=0.5, lbl_coef=0.1)
    Vocab = nt.Axis("vocab", 20)
    model = mtp.build(Vocab, key=jax.random.key(3))
    ids = nt.named(jax.random.randint(jax.random.key(4), (2, 16), 0, 20, jnp.int32), ("batch", "position"))

    def losses(m, x):
        return m.activations_and_aux(x), lm.next_token_loss(m, x, with_aux=True), lm.next_token_loss(m, x)

    (hidden, aux), (total, _), ce = eqx.filter_jit(losses)(model, ids)

    # The reference: each depth's norms, [embedding; hidden] projection, shifts, masks, shared head and
    # cross-entropy in plain jax.numpy; only the depth's DeepSeek-V3 block is the model's own module.
    eps, tokens = mtp.layer_norm_epsilon, ids.array
    table = nt.permute(model.embed_tokens.weight, ("vocab", "embed")).array
    head = nt.permute(model.unembedding(), ("vocab", "embed")).array
    positions = nt.arange(nt.Axis("position", 16), dtype=jnp.int32)
    h, expected = nt.permute(hidden, ("batch", "position", "embed")).array, []
    for k, depth in enumerate(model.mtp, start=1):
        ahead, targets = jnp.roll(tokens, -k, axis=1), jnp.roll(tokens, -(k + 1), axis=1)
        joined = jnp.concatenate(
            [_rms(table[ahead], depth.enorm.weight.array, eps), _rms(h, depth.hnorm.weight.array, eps)], -1
        )
        projected = joined @ nt.permute(depth.eh_proj.weight, ("embed", "mtp_input")).array.T
        out, _ = depth.block(
            nt.named(projected, ("batch", "position", "embed")),
            None,
            positions,
            key=None,
            inference=True,
            cache_offset=0,
        )
        h = nt.permute(out, ("batch", "position", "embed")).array
        logp = jax.nn.log_softmax(_rms(h, depth.norm.weight.array, eps) @ head.T, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        scored = jnp.broadcast_to(jnp.arange(16) < 16 - k - 1, (2, 16)).astype(jnp.float32)
        expected.append(jnp.sum(nll * scored) / jnp.sum(scored))
    assert len(expected) == 2
    np.testing.assert_allclose(aux["mtp_loss"], (expected[0] + expected[1]) / 2, rtol=2e-5)
    assert float(aux["mtp_loss"]) > 2.0  # ln(20) = 3.0 for a fresh model: not a zero that a dropped term would give
    expected_total = ce.array + 0.1 * aux["router_aux_loss"] + 0.5 * aux["mtp_loss"]
    np.testing.assert_allclose(total.array, expected_total, rtol=1e-6)

    # mtp_depth 0 (the default): the same main weights from the same key, no MTP loss, and the same program as the
    # model above with its MTP depths taken away.
    plain = dataclasses.replace(mtp, mtp_depth=0)
    without = plain.build(Vocab, key=jax.random.key(3))
    stripped = dataclasses.replace(model, mtp=(), config=plain)
    for a, b in zip(jax.tree.leaves(without), jax.tree.leaves(stripped), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert "mtp_loss" not in plain.aux_loss_weights()
    # An export keeps the MTP depths (DeepSeek-V3's checkpoints hold them: see hf-bridge's test_deepseek_mtp).
    assert model.for_export() is model and without.for_export() is without

    def program(m):
        params, static = eqx.partition(m, eqx.is_array)
        fn = lambda p: lm.next_token_loss(eqx.combine(p, static), ids, with_aux=True)  # noqa: E731
        return str(jax.make_jaxpr(fn)(params))

    assert program(without) == program(stripped)
    assert program(model) != program(stripped)  # the comparison sees the MTP depths when they are there
