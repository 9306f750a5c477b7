"""Generation: KV-cached decoding equals recomputing the prefix; greedy equals a plain argmax loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lm_models as lm
import named_tensors as nt
from named_tensors import Axis

VOCAB = Axis("vocab", 64)

TINY = {
    "gpt2": lambda: lm.Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4),
    "llama": lambda: lm.LlamaConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2
    ),
    "mpt": lambda **kw: lm.MptConfig(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4, clip_qkv=2.0, **kw),
    "backpack": lambda **kw: lm.BackpackConfig(
        seq_len=16, hidden_dim=32, num_layers=2, num_heads=4, num_senses=4, sense_intermediate_scale=2, **kw
    ),
}
FAMILIES = sorted(TINY)


def greedy_by_recomputing(model, prompt: np.ndarray, new: int) -> np.ndarray:
    """Greedy decoding the slow, obvious way: run the whole prefix again for every new token."""
    seq = prompt
    forward = jax.jit(lambda m, x: m(x).array)
    for _ in range(new):
        logits = forward(model, nt.named(jnp.asarray(seq), ("batch", "position")))
        seq = np.concatenate([seq, np.asarray(logits[:, -1].argmax(-1))[:, None].astype(seq.dtype)], axis=1)
    return seq


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_with_and_without_cache_equals_recomputing(family, ids_of):
    model = TINY[family]().build(VOCAB, key=jax.random.key(0))
    prompt = ids_of(7, batch=2, length=5)
    expected = greedy_by_recomputing(model, np.asarray(prompt.array), 4)
    cached = lm.generate(model, prompt, 4, temperature=0.0)
    uncached = lm.generate(model, prompt, 4, temperature=0.0, use_cache=False)
    assert cached.axis_names == ("batch", "position") and cached.axis_size("position") == 9
    np.testing.assert_array_equal(np.asarray(cached.array), expected)
    np.testing.assert_array_equal(np.asarray(uncached.array), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_with_cache_matches_without(family, ids_of):
    model = TINY[family]().build(VOCAB, key=jax.random.key(1))
    prompt = ids_of(8, batch=3, length=4)
    kw = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "key": jax.random.key(2)}
    cached = lm.generate(model, prompt, 8, **kw)
    uncached = lm.generate(model, prompt, 8, use_cache=False, **kw)
    np.testing.assert_array_equal(np.asarray(cached.array), np.asarray(uncached.array))
    np.testing.assert_array_equal(np.asarray(cached.array[:, :4]), np.asarray(prompt.array))
    other = lm.generate(model, prompt, 8, **{**kw, "key": jax.random.key(3)})
    assert not np.array_equal(np.asarray(other.array), np.asarray(cached.array))


def test_generation_of_a_single_unbatched_prompt(ids_of):
    model = TINY["llama"]().build(VOCAB, key=jax.random.key(0))
    prompt = ids_of(9, batch=1, length=3)["batch", 0]
    out = lm.generate(model, prompt, 2, temperature=0.0)
    assert out.axis_names == ("position",)
    expected = greedy_by_recomputing(model, np.asarray(prompt.array)[None], 2)[0]
    np.testing.assert_array_equal(np.asarray(out.array), expected)


def test_generation_errors_are_clear(ids_of):
    model = TINY["gpt2"]().build(VOCAB, key=jax.random.key(0))
    prompt = ids_of(0, length=10)
    with pytest.raises(ValueError, match="exceeds the 16 positions"):
        lm.generate(model, prompt, 7, temperature=0.0)
    with pytest.raises(ValueError, match="needs key="):
        lm.generate(model, prompt, 2)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        lm.generate(model, prompt, 0, temperature=0.0)


def test_top_k_and_top_p_filters_keep_the_right_tokens():
    V = Axis("vocab", 5)
    logits = nt.named(jnp.log(jnp.array([0.1, 0.4, 0.05, 0.3, 0.15])), (V,))
    kept_k = np.isfinite(np.asarray(lm.top_k_filter(logits, V, 2).array))
    np.testing.assert_array_equal(kept_k, [False, True, False, True, False])
    # 0.4 + 0.3 = 0.7 < 0.75, so the third most likely token (0.15) is needed to reach p.
    kept_p = np.isfinite(np.asarray(lm.top_p_filter(logits, V, 0.75).array))
    np.testing.assert_array_equal(kept_p, [False, True, False, True, True])
    kept_small_p = np.isfinite(np.asarray(lm.top_p_filter(logits, V, 0.01).array))
    np.testing.assert_array_equal(kept_small_p, [False, True, False, False, False])
    samples = [int(lm.sample_next_token(logits, V, key=jax.random.key(i), top_k=2).array) for i in range(40)]
    assert set(samples) == {1, 3}
