"""cross_entropy_loss and blockwise_cross_entropy_loss against a plain log-softmax reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from named_tensors import Axis, nn

Batch, Pos, Embed, Vocab = Axis("batch", 2), Axis("position", 3), Axis("embed", 4), Axis("vocab", 11)
TARGETS = np.array([[1, 10, 3], [0, 7, -100]])
MASK = np.array([[True, True, False], [True, True, False]])


def _reference(logits, targets, mask, z):
    """Mean over unmasked tokens of -log_softmax[target] + z * logsumexp² (float32)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    safe = jnp.where(mask, targets, 0)
    picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    per_token = jnp.where(mask, lse - picked + z * lse**2, 0.0)
    return jnp.sum(per_token) / jnp.sum(jnp.asarray(mask, jnp.float32))


def _inputs(dtype=jnp.float32):
    hidden = nt.named(jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4)).astype(dtype), (Batch, Pos, Embed))
    weight = nt.named(jax.random.normal(jax.random.PRNGKey(1), (11, 4)).astype(dtype), (Vocab, Embed))
    targets = nt.named(jnp.asarray(TARGETS), (Batch, Pos))
    mask = nt.named(jnp.asarray(MASK), (Batch, Pos))
    return hidden, weight, targets, mask


def test_cross_entropy_mean_sum_none_and_z_loss():
    hidden, weight, targets, mask = _inputs()
    logits = nt.dot(hidden, weight, axis=Embed)
    for z in (0.0, 1e-2):
        got = nn.cross_entropy_loss(logits, Vocab, targets, mask=mask, z_loss_weight=z)
        np.testing.assert_allclose(got.scalar(), _reference(logits.array, TARGETS, MASK, z), rtol=1e-6)
    total = nn.cross_entropy_loss(logits, Vocab, targets, mask=mask, reduction="sum")
    per_token = nn.cross_entropy_loss(logits, Vocab, targets, mask=mask, reduction=None)
    assert per_token.axis_names == ("batch", "position")
    assert float(per_token.array[0, 2]) == 0.0 and float(per_token.array[1, 2]) == 0.0
    np.testing.assert_allclose(total.scalar(), per_token.array.sum(), rtol=1e-6)
    np.testing.assert_allclose(total.scalar(), 4 * _reference(logits.array, TARGETS, MASK, 0.0), rtol=1e-6)


def test_cross_entropy_vocab_axis_anywhere_and_no_mask():
    hidden, weight, _, _ = _inputs()
    logits = nt.permute(nt.dot(hidden, weight, axis=Embed), ("vocab", "position", "batch"))
    targets = nt.named(jnp.array([[1, 2, 3], [4, 5, 6]]), (Batch, Pos))
    got = nn.cross_entropy_loss(logits, Vocab, targets)
    ref = _reference(nt.permute(logits, ("batch", "position", "vocab")).array, targets.array, np.ones((2, 3), bool), 0)
    np.testing.assert_allclose(got.scalar(), ref, rtol=1e-6)


def test_bf16_logits_are_upcast_and_bad_targets_are_nan():
    hidden, weight, targets, mask = _inputs()
    logits = nt.dot(hidden, weight, axis=Embed)
    got = nn.cross_entropy_loss(logits.astype(jnp.bfloat16), Vocab, targets, mask=mask)
    assert got.dtype == jnp.float32
    ref = _reference(logits.array.astype(jnp.bfloat16).astype(jnp.float32), TARGETS, MASK, 0.0)
    np.testing.assert_allclose(got.scalar(), ref, rtol=1e-6)
    # -100 at an unmasked position is an error we cannot raise under jit: it must show as NaN.
    assert np.isnan(float(nn.cross_entropy_loss(logits, Vocab, targets).scalar()))
    nothing = nt.named(jnp.zeros((2, 3), bool), (Batch, Pos))
    assert float(nn.cross_entropy_loss(logits, Vocab, targets, mask=nothing).scalar()) == 0.0
    grad = jax.grad(lambda lg: nn.cross_entropy_loss(lg, Vocab, targets, mask=nothing).scalar())(logits)
    assert np.isfinite(grad.array).all()


def test_cross_entropy_errors():
    hidden, weight, targets, _ = _inputs()
    logits = nt.dot(hidden, weight, axis=Embed)
    with pytest.raises(ValueError, match="reduction"):
        nn.cross_entropy_loss(logits, Vocab, targets, reduction="avg")
    with pytest.raises(TypeError, match="integer"):
        nn.cross_entropy_loss(logits, Vocab, targets.astype(jnp.float32))
    with pytest.raises(ValueError, match="targets axes"):
        nn.cross_entropy_loss(logits, Vocab, nt.named(jnp.array([1, 2]), (Batch,)))
    with pytest.raises(ValueError, match="mask has axes"):
        nn.cross_entropy_loss(logits, Vocab, targets, mask=nt.named(jnp.ones((4,), bool), (Embed,)))
    with pytest.raises(ValueError, match="Unknown axis 'vocabulary'"):
        nn.cross_entropy_loss(logits, "vocabulary", targets)


@pytest.mark.parametrize("block_size", [4, 11, 64])
def test_blockwise_loss_and_gradients_equal_the_plain_ones_under_jit(block_size):
    hidden, weight, targets, mask = _inputs()

    @jax.jit
    def plain(h, w):
        return nn.cross_entropy_loss(nt.dot(h, w, axis=Embed), Vocab, targets, mask=mask, z_loss_weight=1e-2).scalar()

    @jax.jit
    def blockwise(h, w):
        loss = nn.blockwise_cross_entropy_loss(
            h, w, Embed, Vocab, targets, block_size=block_size, mask=mask, z_loss_weight=1e-2
        )
        return loss.scalar()

    np.testing.assert_allclose(blockwise(hidden, weight), plain(hidden, weight), rtol=1e-6)
    np.testing.assert_allclose(
        blockwise(hidden, weight), _reference(nt.dot(hidden, weight, axis=Embed).array, TARGETS, MASK, 1e-2), rtol=1e-6
    )
    got = jax.grad(blockwise, argnums=(0, 1))(hidden, weight)
    want = jax.grad(plain, argnums=(0, 1))(hidden, weight)
    for g, w in zip(got, want, strict=True):
        assert g.axis_names == w.axis_names
        np.testing.assert_allclose(g.array, w.array, rtol=1e-5, atol=1e-7)


def test_blockwise_per_token_sum_transposed_weight_and_errors():
    hidden, weight, targets, mask = _inputs()
    logits = nt.dot(hidden, weight, axis=Embed)
    transposed = nt.permute(weight, ("embed", "vocab"))
    per_token = nn.blockwise_cross_entropy_loss(
        hidden, transposed, Embed, Vocab, targets, block_size=3, mask=mask, reduction=None
    )
    np.testing.assert_allclose(
        per_token.array, nn.cross_entropy_loss(logits, Vocab, targets, mask=mask, reduction=None).array, rtol=1e-6
    )
    bad = nn.blockwise_cross_entropy_loss(hidden, weight, Embed, Vocab, targets, block_size=3)
    assert np.isnan(float(bad.scalar()))
    with pytest.raises(ValueError, match="block_size"):
        nn.blockwise_cross_entropy_loss(hidden, weight, Embed, Vocab, targets, block_size=0)
    with pytest.raises(ValueError, match="exactly the axes"):
        nn.blockwise_cross_entropy_loss(hidden, hidden, Embed, Vocab, targets, block_size=3)
    with pytest.raises(TypeError, match="dtype"):
        nn.blockwise_cross_entropy_loss(hidden.astype(jnp.bfloat16), weight, Embed, Vocab, targets, block_size=3)
    with pytest.raises(ValueError, match="targets' axes"):
        nn.blockwise_cross_entropy_loss(
            hidden, weight, Embed, Vocab, nt.named(jnp.array([1, 2]), (Batch,)), block_size=3
        )


def test_blockwise_loss_never_holds_the_full_logits():
    Tok, E, V = Axis("position", 64), Axis("embed", 16), Axis("vocab", 8192)
    hidden = nt.named(jnp.ones((64, 16)), (Tok, E))
    weight = nt.named(jnp.ones((8192, 16)), (V, E))
    targets = nt.named(jnp.zeros((64,), jnp.int32), (Tok,))

    def loss(h, w):
        return nn.blockwise_cross_entropy_loss(h, w, E, V, targets, block_size=256).scalar()

    full_logits = 64 * 8192 * 4
    for fn in (loss, jax.grad(loss, argnums=(0, 1))):
        compiled = jax.jit(fn).lower(hidden, weight).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < full_logits / 4
