"""DeepSeek-V3's layers: group-limited sigmoid routing and its mixture against a per-token numpy reference, the
sequence-wise balance loss, and latent attention (cached decoding equal to the full pass, a cache of latents
only, interleaved rope features equal to reordered weights)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from named_tensors import Axis, nn

Embed, Experts, Mlp, Heads = Axis("embed", 12), Axis("experts", 6), Axis("mlp", 5), Axis("heads", 3)
K, GROUPS, TOP_GROUPS = 3, 3, 2


@eqx.filter_jit
def call(module, *args, **kwargs):
    """module(*args, **kwargs) compiled: one program rather than many small eager ops."""
    return module(*args, **kwargs)


def _reference_routing(logits: np.ndarray, bias: np.ndarray, scaling: float):
    """Per token, in plain numpy: the experts DeepSeek-V3 picks and their weights (ids sorted)."""
    ids_out, weights_out = [], []
    for row in logits.reshape(-1, logits.shape[-1]):
        scores = 1 / (1 + np.exp(-row.astype(np.float64)))
        choice = scores + bias
        groups = choice.reshape(GROUPS, -1)
        rating = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = set(np.argsort(-rating)[:TOP_GROUPS])
        allowed = [e for e in range(len(row)) if e // (len(row) // GROUPS) in keep]
        ids = sorted(sorted(allowed, key=lambda e: -choice[e])[:K])
        w = scores[ids] / scores[ids].sum() * scaling
        ids_out.append(ids)
        weights_out.append(w)
    return np.array(ids_out), np.array(weights_out)


def _moe(seed=0):
    moe = nn.GroupLimitedMoE.init(
        Embed, Experts, Mlp, K, key=jax.random.key(seed), num_shared=2, num_groups=GROUPS, top_groups=TOP_GROUPS,
        scaling_factor=1.5, init_scale=0.4,
    )  # fmt: skip
    # A bias large enough to change which experts win, so that a weight taken from biased scores would show.
    bias = jax.random.normal(jax.random.key(seed + 7), (Experts.size,)) * 0.5
    return eqx_replace(moe, correction_bias=nt.named(bias, (Experts,)))


def eqx_replace(module, **changes):
    import dataclasses

    return dataclasses.replace(module, **changes)


def _x(batch=2, length=7, seed=1):
    values = jax.random.normal(jax.random.key(seed), (batch, length, Embed.size))
    return nt.named(values, ("batch", "position", "embed"))


def test_routing_and_the_mixture_match_a_per_token_reference():
    moe, x = _moe(), _x()
    logits = np.einsum("bte,xe->btx", np.asarray(x.array), np.asarray(moe.router.weight.array))
    bias = np.asarray(moe.correction_bias.array, np.float64)
    ref_ids, ref_w = _reference_routing(logits, bias, 1.5)
    weights, ids = nn.group_limited_routing(
        nt.named(jnp.asarray(logits), ("batch", "position", "experts")), "experts", K,
        correction_bias=moe.correction_bias, num_groups=GROUPS, top_groups=TOP_GROUPS, scaling_factor=1.5,
    )  # fmt: skip
    order = np.argsort(np.asarray(ids.array).reshape(-1, K), axis=-1)
    got_ids = np.take_along_axis(np.asarray(ids.array).reshape(-1, K), order, -1)
    got_w = np.take_along_axis(np.asarray(weights.array).reshape(-1, K), order, -1)
    np.testing.assert_array_equal(got_ids, ref_ids)
    np.testing.assert_allclose(got_w, ref_w, rtol=1e-5)
    # Without the bias some tokens choose other experts: it steers the choice.
    _, plain = nn.group_limited_routing(
        nt.named(jnp.asarray(logits), ("batch", "position", "experts")), "experts", K, num_groups=GROUPS,
        top_groups=TOP_GROUPS,
    )  # fmt: skip
    assert not np.array_equal(np.sort(np.asarray(plain.array), -1).reshape(-1, K), ref_ids)

    out, aux = call(moe, x)
    xs = np.asarray(x.array).reshape(-1, Embed.size)
    e = moe.experts
    expected = []
    for t, (row_ids, row_w) in enumerate(zip(ref_ids, ref_w, strict=True)):
        y = np.zeros(Embed.size)
        for i, w in zip(row_ids, row_w, strict=True):
            g, u = np.asarray(e.gate.array[i]) @ xs[t], np.asarray(e.up.array[i]) @ xs[t]
            y += w * (np.asarray(e.down.array[i]) @ (g / (1 + np.exp(-g)) * u))
        s = moe.shared
        g, u = np.asarray(s.gate.weight.array) @ xs[t], np.asarray(s.up.weight.array) @ xs[t]
        expected.append(y + np.asarray(s.down.weight.array) @ (g / (1 + np.exp(-g)) * u))
    got = np.asarray(nt.permute(out, ("batch", "position", "embed")).array).reshape(-1, Embed.size)
    np.testing.assert_allclose(got, np.array(expected), atol=1e-5)

    # The sequence-wise balance loss, per sequence: sum_e (E / (k T)) * count_e * mean_t(s_e / sum s).
    scores = 1 / (1 + np.exp(-logits))
    share = scores / scores.sum(-1, keepdims=True)
    counts = np.stack([np.bincount(ref_ids.reshape(2, -1, K)[b].ravel(), minlength=6) for b in range(2)])
    loss = np.mean(np.sum(counts * 6 / (K * 7) * share.mean(1), -1))
    np.testing.assert_allclose(float(aux["router_aux_loss"]), loss, rtol=1e-5)


def test_a_bad_grouping_is_refused_before_any_weight_is_drawn():
    with pytest.raises(ValueError, match="num_groups=4 equal groups"):
        nn.GroupLimitedMoE.init(Embed, Experts, Mlp, 2, key=jax.random.key(0), num_groups=4)
    with pytest.raises(ValueError, match="k=5 must be between 1 and the 4 experts"):
        nn.GroupLimitedMoE.init(Embed, Experts, Mlp, 5, key=jax.random.key(0), num_groups=3, top_groups=2)


def _attention(interleave=False, q_lora_rank=7):
    return nn.LatentAttention.init(
        Embed, Heads, q_lora_rank=q_lora_rank, kv_lora_rank=5, qk_nope_dim=4, qk_rope_dim=6, v_head_dim=3,
        rotary=nn.RotaryEmbeddings(6, 100.0), key=jax.random.key(3), interleave=interleave, init_scale=0.3,
    )  # fmt: skip


def test_latent_attention_decodes_from_a_cache_of_latents_as_the_full_pass_computes():
    attn, x = _attention(), _x(length=6)
    Pos = x.resolve_axis("position")
    full, _ = call(attn, x, nt.arange(Pos, dtype=jnp.int32))
    batch = (x.resolve_axis("batch"),)
    cache = nn.LatentCache.zeros(batch, Axis("key_position", 6), Axis("kv_lora", 5), Axis("qk_rope", 6))
    # What decoding keeps per position: the latent and the shared rope key, 5 + 6 numbers (not 3 heads x (10 + 3)).
    assert cache.latent.array.size + cache.rope_key.array.size == 2 * 6 * (5 + 6)
    prefix, cache = call(attn, x["position", 0:4], nt.arange(Axis("position", 4), dtype=jnp.int32), cache=cache)
    steps = [prefix]
    for t in (4, 5):
        one = x["position", t : t + 1]
        out, cache = call(
            attn, one, nt.arange(Axis("position", 1), start=t, dtype=jnp.int32), cache=cache, cache_offset=t
        )
        steps.append(out)
    decoded = nt.concatenate("position", steps)
    order = ("batch", "position", "embed")
    np.testing.assert_allclose(nt.permute(decoded, order).array, nt.permute(full, order).array, atol=1e-5)


def test_interleaved_rope_features_equal_the_halves_layout_with_reordered_weights():
    inter, x = _attention(interleave=True, q_lora_rank=None), _x(length=5)
    pos = nt.arange(x.resolve_axis("position"), dtype=jnp.int32)
    # Pairs (0, 1), (2, 3), (4, 5) of the rope features become halves (0, 2, 4 | 1, 3, 5).
    perm = np.array([0, 2, 4, 1, 3, 5])
    q = inter.q_proj.weight.array  # (heads, head_size = 4 nope + 6 rope, embed)
    q = q.at[:, 4:].set(q[:, 4:][:, perm])
    k = inter.k_rope_proj.weight.array[perm]
    import dataclasses

    halves = dataclasses.replace(
        inter,
        interleave=False,
        q_proj=dataclasses.replace(inter.q_proj, weight=nt.named(q, inter.q_proj.weight.axes)),
        k_rope_proj=dataclasses.replace(inter.k_rope_proj, weight=nt.named(k, inter.k_rope_proj.weight.axes)),
    )
    order = ("batch", "position", "embed")
    a, b = nt.permute(call(inter, x, pos)[0], order).array, nt.permute(call(halves, x, pos)[0], order).array
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_the_aux_loss_free_bias_update_balances_a_skewed_router():
    """Tokens whose router favours the first experts: nudging the correction bias toward balance after every batch
    (outside any gradient) evens out the load, while the weights stay the unbiased scores."""
    logits = jax.random.normal(jax.random.key(5), (64, 8, Experts.size)) + jnp.array(
        [[[2.0, 1.5, 1.0, 0.0, -1.0, -2.0]]]
    )
    named = nt.named(logits, ("batch", "position", "experts"))

    def route(bias):
        return nn.group_limited_routing(
            named, "experts", K, correction_bias=bias, num_groups=GROUPS, top_groups=TOP_GROUPS
        )  # fmt: skip

    def one_step(_, bias):
        _, ids = route(bias)
        return nn.balance_bias_update(bias, nn.expert_load(ids, Experts), 0.02)

    start = nt.named(jnp.zeros(Experts.size), (Experts,))
    balanced = jax.jit(lambda b: jax.lax.fori_loop(0, 300, one_step, b))(start)
    before = nn.expert_load(route(start)[1], Experts).array
    after = nn.expert_load(route(balanced)[1], Experts).array
    assert float(jnp.sum(after)) == pytest.approx(1.0)
    assert float(before.max() / before.min()) > 5  # skewed: the last experts are hardly chosen
    assert float(after.max() / after.min()) < 1.5, after
    # The bias chooses; the weights are still the chosen experts' unbiased sigmoid scores.
    weights, ids = route(balanced)
    scores = jax.nn.sigmoid(logits)
    chosen = jnp.take_along_axis(scores, ids.array, axis=-1)
    np.testing.assert_allclose(weights.array, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
