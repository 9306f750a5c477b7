"""Backpack: the sense mixing against a plain jax.numpy computation, plus config errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lm_models as lm
import named_tensors as nt
from named_tensors import Axis

VOCAB = Axis("vocab", 64)


def arr(x: nt.NamedArray, *order: str) -> jax.Array:
    return nt.permute(x, order).array


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def reference_backpack(model: lm.BackpackLMHeadModel, ids: jax.Array) -> jax.Array:
    """Backpack logits from the transformer's hidden states (GPT-2, tested on its own) and raw sense weights."""
    c = model.config
    S, E, D = c.num_senses, c.hidden_dim, c.hidden_dim // c.num_senses
    named_ids = nt.named(ids, ("batch", "position"))
    hidden = arr(model.transformer.activations(named_ids)[0], "batch", "position", "embed")
    wte = arr(model.transformer.token_embeddings.weight, "vocab", "embed")
    e = wte[ids]
    net = model.sense_net
    gelu = lambda x: jax.nn.gelu(x, approximate=True)  # noqa: E731
    block = gelu(e @ arr(net.block.up.weight, "embed", "mlp") + arr(net.block.up.bias, "mlp"))
    block = block @ arr(net.block.down.weight, "mlp", "embed") + arr(net.block.down.bias, "embed")
    x = layer_norm(e + block, arr(net.ln.weight, "embed"), arr(net.ln.bias, "embed"), c.layer_norm_epsilon)
    up = gelu(x @ arr(net.final.up.weight, "embed", "mlp") + arr(net.final.up.bias, "mlp"))
    senses = jnp.einsum("bsm,lem->bsle", up, arr(net.final.down.weight, "senses", "embed", "mlp"))
    senses = senses + arr(net.final.down.bias, "senses", "embed")
    q = jnp.einsum("bse,lde->bsld", hidden, arr(model.sense_query.weight, "senses", "head_size", "embed"))
    k = jnp.einsum("bse,lde->bsld", hidden, arr(model.sense_key.weight, "senses", "head_size", "embed"))
    q = q + arr(model.sense_query.bias, "senses", "head_size")
    k = k + arr(model.sense_key.bias, "senses", "head_size")
    seq = ids.shape[1]
    scores = jnp.einsum("bild,bjld->blij", q, k) / math.sqrt(D)
    alpha = jax.nn.softmax(jnp.where(np.tril(np.ones((seq, seq), bool)), scores, -jnp.inf), axis=-1)
    out = jnp.einsum("blij,bjle->bie", alpha, senses) / S
    assert out.shape[-1] == E
    return out @ wte.T


def tiny(**overrides) -> lm.BackpackConfig:
    base = {"seq_len": 16, "hidden_dim": 32, "num_layers": 2, "num_heads": 4, "num_senses": 4}
    return lm.BackpackConfig(**{**base, "sense_intermediate_scale": 2, **overrides})


def test_backpack_matches_plain_jax_sense_mixing(ids_of, random_biases):
    model, _ = random_biases(tiny().build(VOCAB, key=jax.random.key(0)), jax.random.key(8))
    ids = ids_of(11)
    logits = model(ids)
    assert logits.axis_names == ("batch", "position", "vocab")
    with jax.numpy_rank_promotion("allow"):  # the reference broadcasts positionally, as numpy code does
        expected = np.asarray(jax.jit(reference_backpack)(model, ids.array))
    np.testing.assert_allclose(np.asarray(logits.array), expected, atol=2e-5, rtol=1e-5)


def test_backpack_senses_have_their_own_axis():
    model = tiny().build(VOCAB, key=jax.random.key(0))
    assert model.sense_net.final.down.weight.axis_names == ("senses", "embed", "mlp")
    assert model.sense_query.weight.axis_names == ("senses", "head_size", "embed")
    assert model.unembedding() is model.transformer.token_embeddings.weight
    assert lm.LmConfig.get_choice_class("backpack") is lm.BackpackConfig
    assert not isinstance(model.config, lm.Gpt2Config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_senses": 5}, "num_senses=5 does not divide hidden_dim=32"),
        ({"num_senses": 0}, "num_senses must be a positive integer"),
        ({"num_heads": 3}, "num_heads=3 does not divide hidden_dim=32"),
    ],
)
def test_backpack_bad_configs_fail_clearly(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)
