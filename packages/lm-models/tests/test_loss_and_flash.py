"""next_token_loss against a hand-written cross-entropy; blockwise loss and flash attention match the plain ones."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lm_models as lm
import named_tensors as nt
from named_tensors import Axis

VOCAB = Axis("vocab", 64)


def tiny_llama(**kw) -> lm.LlamaConfig:
    return lm.LlamaConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, **kw
    )


def manual_loss(logits: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> float:
    """Mean over scored positions of -log p(ids[t + 1] | logits[t]); weights[t] scales position t."""
    logp = jax.nn.log_softmax(jnp.asarray(logits[:, :-1]), axis=-1)
    picked = np.take_along_axis(np.asarray(logp), ids[:, 1:, None], axis=-1)[..., 0]
    w = weights[:, :-1]
    return float(-(picked * w).sum() / w.sum())


def test_next_token_loss_is_the_shifted_cross_entropy(ids_of):
    model = tiny_llama().build(VOCAB, key=jax.random.key(0))
    ids = ids_of(1)
    logits = np.asarray(jax.jit(lambda m, x: m(x).array)(model, ids))
    raw = np.asarray(ids.array)
    loss = lm.next_token_loss(model, ids)
    np.testing.assert_allclose(float(loss.array), manual_loss(logits, raw, np.ones(raw.shape)), rtol=1e-5)

    keep = np.ones(raw.shape, bool)
    keep[0, :5] = False
    mask = nt.named(jnp.asarray(keep), ("batch", "position"))
    masked = lm.next_token_loss(model, ids, loss_mask=mask)
    np.testing.assert_allclose(float(masked.array), manual_loss(logits, raw, keep.astype(float)), rtol=1e-5)

    per_token = lm.next_token_loss(model, ids, reduction=None)
    assert per_token.axis_names == ("batch", "position")
    assert np.all(np.asarray(per_token.array)[:, -1] == 0), "the last position has no next token"
    total = lm.next_token_loss(model, ids, reduction="sum")
    np.testing.assert_allclose(float(total.array), float(nt.sum(per_token).array), rtol=1e-5)
    with_z = lm.next_token_loss(model, ids, z_loss_weight=1e-2)
    assert float(with_z.array) > float(loss.array)


def test_blockwise_loss_equals_the_plain_loss_and_its_gradient(ids_of):
    model = tiny_llama().build(VOCAB, key=jax.random.key(1))
    ids = ids_of(2)

    def loss(m, x, blockwise):
        return lm.next_token_loss(m, x, blockwise=blockwise, block_size=24, z_loss_weight=1e-3).array

    plain, plain_grad = jax.value_and_grad(loss)(model, ids, False)
    chunked, chunked_grad = jax.value_and_grad(loss)(model, ids, True)
    np.testing.assert_allclose(chunked, plain, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(chunked_grad), jax.tree.leaves(plain_grad), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "config",
    [
        tiny_llama(use_flash_attention=True, flash_attention_block_size=4),
        lm.MptConfig(
            seq_len=16, hidden_dim=32, num_layers=2, num_heads=4, use_flash_attention=True, flash_attention_block_size=8
        ),
    ],
    ids=["llama", "mpt"],
)
def test_flash_attention_gives_the_plain_attention_logits_and_generation(config, ids_of):
    flash = config.build(VOCAB, key=jax.random.key(2))
    plain = dataclasses.replace(config, use_flash_attention=False).build(VOCAB, key=jax.random.key(2))
    ids = ids_of(3)
    np.testing.assert_allclose(flash(ids).array, plain(ids).array, atol=2e-5, rtol=1e-5)
    # Packed rows: blockwise attention takes their segment ids; ours, the whole mask as one array.
    segments = nt.named(jnp.asarray([[0] * 6 + [1] * 10, [0] * 16]), ("batch", "position"))
    packed = flash(ids, nt.nn.AttentionMask.packed(segments)).array
    np.testing.assert_allclose(packed, plain(ids, nt.nn.packed_causal_mask(segments)).array, atol=2e-5, rtol=1e-5)
    assert not np.allclose(packed[0, 6:], plain(ids).array[0, 6:], atol=1e-3)  # the second document is apart
    prompt = ids["position", 0:5]
    np.testing.assert_array_equal(
        lm.generate(flash, prompt, 3, temperature=0.0).array, lm.generate(plain, prompt, 3, temperature=0.0).array
    )


def test_the_config_block_size_and_the_accelerator_default_choose_the_blockwise_loss(ids_of):
    from lm_models.loss import vocabulary_block_size

    ids = ids_of(4)
    plain = tiny_llama().build(VOCAB, key=jax.random.key(5))
    blocked = tiny_llama(cross_entropy_block_size=24).build(VOCAB, key=jax.random.key(5))
    assert vocabulary_block_size(plain) is None and vocabulary_block_size(blocked) == 24
    # the config's block size is what an explicit blockwise=True with that size computes, gradient included
    loss = jax.jit(jax.value_and_grad(lambda m, x: lm.next_token_loss(m, x).array))
    explicit = jax.jit(jax.value_and_grad(lambda m, x: lm.next_token_loss(m, x, blockwise=True, block_size=24).array))
    (got, got_grad), (want, want_grad) = loss(blocked, ids), explicit(plain, ids)
    assert float(got) == float(want)
    for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
        np.testing.assert_array_equal(a, b)
    # an accelerator scores a large vocabulary blockwise by default; a CPU, a small vocabulary or capped logits not
    big = tiny_llama().build(Axis("vocab", 32768), key=jax.random.key(6))
    assert vocabulary_block_size(big, "gpu") == vocabulary_block_size(big, "tpu") == 8192
    assert vocabulary_block_size(big, "cpu") is None and vocabulary_block_size(plain, "gpu") is None
    capped = lm.Gemma2Config(
        seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
    ).build(Axis("vocab", 32768), key=jax.random.key(7))
    assert capped.logits_soft_cap() is not None and vocabulary_block_size(capped, "gpu") is None
    with pytest.raises(ValueError, match=r"cross_entropy_block_size must be a positive number"):
        tiny_llama(cross_entropy_block_size=0)
