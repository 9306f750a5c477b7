"""GPT-2 against a plain jax.numpy forward pass of the same weights, plus its config errors."""

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
    """The raw array of x with its axes in the given order (a stacked leading `layers` is kept first)."""
    if x.has_axis("layers"):
        order = ("layers", *order)
    return nt.permute(x, order).array


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / jnp.sqrt(var + eps) * w
    return y if b is None else y + b


def reference_gpt2(model: lm.Gpt2LMHeadModel, ids: np.ndarray) -> np.ndarray:
    """GPT-2 forward pass written with jax.numpy on raw arrays: ids (batch, seq) -> logits (batch, seq, vocab)."""
    c = model.config
    wte = arr(model.token_embeddings.weight, "vocab", "embed")
    wpe = arr(model.position_embeddings.weight, "position", "embed")
    seq = ids.shape[1]
    x = wte[ids] + wpe[:seq][None]
    b = model.blocks.stacked
    H, D = c.num_heads, c.hidden_dim // c.num_heads
    causal = np.tril(np.ones((seq, seq), bool))
    for i in range(c.num_layers):
        h = layer_norm(x, arr(b.ln_1.weight, "embed")[i], arr(b.ln_1.bias, "embed")[i], c.layer_norm_epsilon)
        q = jnp.einsum("bse,hde->bshd", h, arr(b.attn.q_proj.weight, "heads", "head_size", "embed")[i])
        k = jnp.einsum("bse,hde->bshd", h, arr(b.attn.k_proj.weight, "kv_heads", "head_size", "embed")[i])
        v = jnp.einsum("bse,hde->bshd", h, arr(b.attn.v_proj.weight, "kv_heads", "head_size", "embed")[i])
        q = q + arr(b.attn.q_proj.bias, "heads", "head_size")[i]
        k = k + arr(b.attn.k_proj.bias, "kv_heads", "head_size")[i]
        v = v + arr(b.attn.v_proj.bias, "kv_heads", "head_size")[i]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        if c.scale_attn_by_inverse_layer_idx:
            scores = scores / (i + 1)
        scores = jnp.where(causal, scores, -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        out = jnp.einsum("bqhd,ehd->bqe", attn, arr(b.attn.o_proj.weight, "embed", "heads", "head_size")[i])
        x = x + out + arr(b.attn.o_proj.bias, "embed")[i]
        h = layer_norm(x, arr(b.ln_2.weight, "embed")[i], arr(b.ln_2.bias, "embed")[i], c.layer_norm_epsilon)
        up = h @ arr(b.mlp.up.weight, "embed", "mlp")[i] + arr(b.mlp.up.bias, "mlp")[i]
        up = jax.nn.gelu(up, approximate=True)
        x = x + up @ arr(b.mlp.down.weight, "mlp", "embed")[i] + arr(b.mlp.down.bias, "embed")[i]
    x = layer_norm(x, arr(model.ln_f.weight, "embed"), arr(model.ln_f.bias, "embed"), c.layer_norm_epsilon)
    assert c.hidden_dim == H * D
    return np.asarray(x @ wte.T)


def tiny(**overrides) -> lm.Gpt2Config:
    return lm.Gpt2Config(**{"seq_len": 16, "hidden_dim": 32, "num_layers": 2, "num_heads": 4, **overrides})


@pytest.mark.parametrize("scale_by_layer", [False, True])
def test_gpt2_matches_plain_jax_reference(scale_by_layer, ids_of, random_biases):
    model = tiny(scale_attn_by_inverse_layer_idx=scale_by_layer).build(VOCAB, key=jax.random.key(0))
    model, biases = random_biases(model, jax.random.key(7))
    assert biases == 9  # q, k, v, o, mlp up and down, ln_1 and ln_2 (stacked over layers), and ln_f
    ids = ids_of(1)
    logits = model(ids)
    assert logits.axis_names == ("batch", "position", "vocab")
    with jax.numpy_rank_promotion("allow"):  # the reference broadcasts positionally, as numpy code does
        expected = reference_gpt2(model, np.asarray(ids.array))
    np.testing.assert_allclose(np.asarray(logits.array), expected, atol=2e-5, rtol=1e-5)


def test_gpt2_without_bias_has_no_bias_parameters(ids_of):
    model = tiny(use_bias=False).build(VOCAB, key=jax.random.key(0))
    block = model.blocks.stacked
    assert block.attn.q_proj.bias is None and block.mlp.up.bias is None and block.ln_1.bias is None
    assert model(ids_of(2)).axis_names == ("batch", "position", "vocab")


def test_gpt2_accepts_unbatched_and_extra_leading_axes(ids_of):
    model = tiny().build(VOCAB, key=jax.random.key(0))
    ids = ids_of(3, batch=2)
    batched = model(ids).array
    single = model(ids["batch", 1])
    assert single.axis_names == ("position", "vocab")
    np.testing.assert_allclose(np.asarray(single.array), np.asarray(batched[1]), atol=1e-6)
    extra = nt.named(ids.array.reshape(1, 2, 16), ("replica", "batch", "position"))
    out = model(extra)
    assert out.axis_names == ("replica", "batch", "position", "vocab")
    np.testing.assert_allclose(np.asarray(out.array[0]), np.asarray(batched), atol=1e-6)


def test_gpt2_rejects_sequences_longer_than_seq_len(ids_of):
    model = tiny().build(VOCAB, key=jax.random.key(0))
    with pytest.raises(ValueError, match="seq_len=16"):
        model(ids_of(0, length=17))


def test_gpt2_rejects_unnamed_ids(ids_of):
    model = tiny().build(VOCAB, key=jax.random.key(0))
    with pytest.raises(TypeError, match="NamedArray"):
        model(jnp.zeros((2, 16), jnp.int32))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_heads": 5}, "num_heads=5 does not divide hidden_dim=32"),
        ({"num_layers": 0}, "num_layers must be a positive integer"),
        ({"resid_pdrop": 1.5}, r"resid_pdrop must be in \[0, 1\)"),
        ({"gradient_checkpointing": "sometimes"}, "gradient_checkpointing='sometimes' is not valid"),
        ({"scan_unroll": 0}, "Gpt2Config.scan_unroll must be true .* positive number of layers .* or auto, got 0"),
        ({"scan_unroll": "all"}, "scan_unroll must be true"),
        ({"activation_function": "gelu_newest"}, "Unknown activation"),
    ],
)
def test_gpt2_bad_configs_fail_clearly(overrides, message, ids_of):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


def test_scan_unroll_auto_unrolls_every_layer_on_cpu_only_where_nothing_is_recomputed():
    no_remat = tiny(gradient_checkpointing=False)
    assert no_remat.scan_unroll == lm.SCAN_UNROLL_AUTO
    assert lm.resolve_scan_unroll(no_remat, "cpu") is True
    assert lm.resolve_scan_unroll(no_remat, "gpu") == lm.resolve_scan_unroll(no_remat, "tpu") == 1
    for policy in (True, "full", "save_block_outputs", "nested"):
        assert lm.resolve_scan_unroll(tiny(gradient_checkpointing=policy), "cpu") == 1
    assert lm.resolve_scan_unroll(tiny(gradient_checkpointing=False, scan_unroll=2), "cpu") == 2  # given: kept
    # The built model follows the devices present (these tests' CPUs), and a new policy re-decides it.
    model = no_remat.build(VOCAB, key=jax.random.key(0))
    assert model.blocks.unroll is True
    assert lm.with_gradient_checkpointing(model, "full").blocks.unroll == 1
    assert lm.with_gradient_checkpointing(model, False, "gpu").blocks.unroll == 1
    assert lm.with_gradient_checkpointing(lm.with_gradient_checkpointing(model, True), False).blocks.unroll is True
    assert tiny().build(VOCAB, key=jax.random.key(0)).blocks.unroll == 1  # the family's default remat
    assert lm.stack_layers(lm.unstack_layers(model)).blocks.unroll is True


def test_gpt2_dropout_follows_the_key_and_inference_mode_turns_it_off(ids_of):
    model = tiny(embed_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.1).build(VOCAB, key=jax.random.key(0))
    ids = ids_of(4)
    forward = jax.jit(lambda m, x, k: m(x, key=k).array)
    no_key = jax.jit(lambda m, x: m(x).array)(model, ids)
    a = forward(model, ids, jax.random.key(1))
    b = forward(model, ids, jax.random.key(2))
    assert not np.allclose(a, no_key), "with a key, dropout is on"
    assert not np.allclose(a, b), "different dropout keys must drop different units"
    np.testing.assert_array_equal(a, forward(model, ids, jax.random.key(1)))
    quiet = lm.inference_mode(model)
    np.testing.assert_array_equal(forward(quiet, ids, jax.random.key(1)), no_key)
    assert not lm.inference_mode(quiet, False).inference
