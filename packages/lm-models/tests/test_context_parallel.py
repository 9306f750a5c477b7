"""Context parallelism in the families: positions split over 4 devices, tokens in the ring's load-balanced order,
give the loss and gradients of the plain model on one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lm_models as lm
import named_tensors as nt
from named_tensors import Axis

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (CPU runs force 8)")

VOCAB = Axis("vocab", 41)
BASE = dict(seq_len=16, hidden_dim=24, intermediate_dim=20, num_layers=2, num_heads=4, num_kv_heads=2)
CONTEXT = 4
# Device i of the ring holds chunks i and 7-i of the 8 chunks of 2 positions.
ORDER = np.concatenate([np.r_[2 * i : 2 * i + 2, 2 * (7 - i) : 2 * (7 - i) + 2] for i in range(CONTEXT)])
# GPT-2's learned positions, and Mixtral for the llama-style decoder (RoPE, grouped-query heads) with experts; a
# sliding window is checked by named-tensors' ring tests (CI time: each case compiles a sharded step).
FAMILIES = {
    "gpt2": lambda: lm.Gpt2Config(seq_len=16, hidden_dim=24, num_layers=2, num_heads=4),
    "mixtral": lambda: lm.MixtralConfig(**BASE, n_routed_experts=4, num_experts_per_tok=2, lbl_coef=0.1),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_ring_over_reordered_tokens_gives_the_one_device_loss_and_gradients(family, ids_of):
    config = FAMILIES[family]()
    model = config.build(VOCAB, key=jax.random.key(0))
    ids = ids_of(5, batch=2, vocab=VOCAB.size)
    # Row 0 packs two documents (positions restart at the second); row 1 is one document.
    segments = nt.named(jnp.asarray([[0] * 6 + [1] * 10, [0] * 16], jnp.int32), ids.axes)
    positions = nt.named(jnp.asarray([list(range(6)) + list(range(10)), list(range(16))], jnp.int32), ids.axes)
    packed = {"attn_mask": nt.nn.AttentionMask.packed(segments), "positions": positions}

    def plain(m):
        return lm.next_token_loss(m, ids, with_aux=True, **packed)[0].array

    # The ring's inputs: every per-token field in ORDER, and the targets taken before the reordering.
    targets, scored = lm.next_token_targets(ids)
    order = nt.named(jnp.asarray(ORDER), (ids.resolve_axis("position"),))

    def reordered(x):
        return nt.take(x, "position", order)

    ring_inputs = {
        "attn_mask": nt.nn.AttentionMask.packed(reordered(segments)),
        "positions": reordered(positions),
        "targets": reordered(targets),
        "loss_mask": reordered(scored.broadcast_to(ids.axes)),
    }
    mesh = nt.make_mesh({"data": 2, "context": CONTEXT})
    mapping = {"batch": "data", "position": "context"}

    def ring(m, x, inputs):
        with nt.axis_mapping(mapping, mesh=mesh):
            return lm.next_token_loss(m, nt.shard(x), with_aux=True, **inputs)[0].array

    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(plain))(model)
    ring_value, ring_grads = eqx.filter_jit(eqx.filter_value_and_grad(ring))(model, reordered(ids), ring_inputs)
    np.testing.assert_allclose(ring_value, value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(ring_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_ring_attention_refuses_what_it_cannot_take(ids_of):
    model = lm.Gpt2Config(seq_len=16, hidden_dim=24, num_layers=2, num_heads=4).build(VOCAB, key=jax.random.key(0))
    ids = ids_of(1, vocab=VOCAB.size)
    keep = nt.named(jnp.ones((2, 16), bool), (ids.axes[0], Axis("key_position", 16)))
    mesh = nt.make_mesh({"data": 2, "context": CONTEXT})
    mapping = {"batch": "data", "position": "context"}
    with nt.axis_mapping(mapping, mesh=mesh), pytest.raises(ValueError, match="does not take an explicit attention"):
        lm.next_token_loss(model, ids, attn_mask=keep)
