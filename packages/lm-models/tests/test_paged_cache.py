"""Paged KV cache: chunked prefill then decoding through scattered pages gives the full forward's logits, for
each family's attention (GQA, ALiBi, sliding windows, per-layer windows and local RoPE, soft-capping)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lm_models as lm
import named_tensors as nt
from named_tensors import Axis

VOCAB = Axis("vocab", 41)
BASE = dict(seq_len=16, hidden_dim=24, intermediate_dim=20, num_layers=2, num_heads=4, num_kv_heads=2)

FAMILIES = {
    "llama": lambda: lm.LlamaConfig(**BASE),
    "gemma2_window_softcap": lambda: lm.Gemma2Config(
        **BASE,
        head_dim=8,
        sliding_window=3,
        query_pre_attn_scalar=6,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
    ),
    "gemma3_layer_windows": lambda: lm.Gemma3Config(
        **BASE, head_dim=8, sliding_window=3, sliding_window_pattern=2, rope_local_base_freq=100.0
    ),
}

PAGE_SIZE = 4
NUM_PAGES = 12
# Two sequences of 13 and 9 tokens on pages out of order; 0 marks an unused entry (the null page).
TABLES = np.array([[5, 2, 9, 7], [3, 11, 1, 0]], np.int32)
LENGTHS = np.array([13, 9])


def _paged_logits_by_step(model, ids: np.ndarray) -> np.ndarray:
    """Each real token's logits, computed by two prefill chunks of 5 then one token at a time through the pool."""
    cache = lm.init_paged_cache(model.config, NUM_PAGES, PAGE_SIZE)
    step = eqx.filter_jit(lm.paged_forward)
    table = nt.named(jnp.asarray(TABLES), ("batch", "page_index"))
    out = np.zeros((*ids.shape, VOCAB.size), np.float32)
    starts = [(0, 5), (5, 5), *((p, 1) for p in range(10, int(LENGTHS.max())))]
    for start, size in starts:
        positions = np.arange(start, start + size)[None, :].repeat(2, 0)
        valid = positions < LENGTHS[:, None]
        chunk = np.where(valid, ids[:, start : start + size], 0)
        logits, cache = step(
            model,
            cache,
            nt.named(jnp.asarray(chunk, jnp.int32), ("batch", "position")),
            nt.named(jnp.asarray(positions, jnp.int32), ("batch", "position")),
            nt.named(jnp.asarray(valid), ("batch", "position")),
            table,
        )
        logits = np.asarray(nt.permute(logits, ("batch", "position", "vocab")).array)
        for b in range(2):
            for i, p in enumerate(positions[b]):
                if valid[b, i]:
                    out[b, p] = logits[b, i]
    return out, cache


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_paged_decoding_equals_the_full_forward(family):
    model = lm.inference_mode(FAMILIES[family]().build(VOCAB, key=jax.random.key(3)))
    ids = np.asarray(jax.random.randint(jax.random.key(4), (2, 16), 0, VOCAB.size, dtype=jnp.int32))
    full = eqx.filter_jit(lambda m, x: nt.permute(m(x), ("batch", "position", "vocab")).array)
    reference = np.asarray(full(model, nt.named(jnp.asarray(ids), ("batch", "position"))))
    paged, cache = _paged_logits_by_step(model, ids)
    for b, length in enumerate(LENGTHS):
        np.testing.assert_allclose(paged[b, :length], reference[b, :length], atol=2e-5, rtol=1e-5)
    # Only the sequences' pages (and the null page, which takes the padding) were written.
    written = np.abs(np.asarray(nt.permute(cache.key, ("page", ...)).array)).reshape(NUM_PAGES, -1).max(axis=1) > 0
    used = set(TABLES.ravel()) - {0}
    assert {int(p) for p in np.flatnonzero(written)} - {0} == used


def test_paged_cache_needs_room_and_a_model_that_takes_positions():
    with pytest.raises(ValueError, match="at least 2 pages"):
        lm.init_paged_cache(FAMILIES["llama"](), 1, 4)
    mpt = lm.MptConfig(seq_len=16, hidden_dim=24, num_layers=2, num_heads=4).build(VOCAB, key=jax.random.key(0))
    assert not lm.supports_paging(mpt)
    assert lm.supports_paging(FAMILIES["llama"]().build(VOCAB, key=jax.random.key(0)))
