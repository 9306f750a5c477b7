"""Autoregressive generation: a KV-cached prefill and decode loop, or full-prefix recomputation, under jit."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import Axis, NamedArray

from .model import POSITION, LmHeadModel, batch_axes_of, check_input_ids, inference_mode
from .sampling import sample_next_token


def generate(
    model: LmHeadModel,
    prompt_ids: NamedArray,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key: jax.Array | None = None,
    use_cache: bool = True,
) -> NamedArray:
    """The prompt followed by max_new_tokens sampled tokens: axes (..., position) of length prompt + new.

    temperature=0 is greedy decoding (no key needed). Step i draws with jax.random.fold_in(key, i), so the
    cached and uncached paths sample the same tokens from the same logits. Dropout is off.
    """
    prompt_ids = check_input_ids(prompt_ids, None)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if temperature > 0 and key is None:
        raise ValueError("Sampling with temperature > 0 needs key=jax.random.key(...); use temperature=0 for greedy")
    total = prompt_ids.axis_size(POSITION) + max_new_tokens
    limit = getattr(model.config, "max_positions", None)
    if limit is not None and total > limit:
        raise ValueError(
            f"prompt ({prompt_ids.axis_size(POSITION)} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds the {limit} positions this model has (seq_len); generate fewer tokens"
        )
    if key is None:
        key = jax.random.key(0)  # unused by greedy decoding; keeps one traced signature
    model = inference_mode(model)
    sampling = (float(temperature), top_k, top_p)
    if use_cache:
        return _generate_cached(model, prompt_ids, key, max_new_tokens, sampling)
    return _generate_recomputing(model, prompt_ids, key, max_new_tokens, sampling)


def _as_one_position(token: NamedArray) -> NamedArray:
    """Token ids (...,) as a sequence of length one: axes (..., position=1)."""
    return NamedArray(token.array[..., None], (*token.axes, Axis(POSITION, 1)))


def _sample(logits: NamedArray, model: LmHeadModel, key: jax.Array, step, sampling) -> NamedArray:
    temperature, top_k, top_p = sampling
    return sample_next_token(
        logits,
        model.Vocab,
        key=jax.random.fold_in(key, step),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    ).astype(jnp.int32)


@eqx.filter_jit
def _generate_cached(
    model: LmHeadModel, prompt_ids: NamedArray, key: jax.Array, max_new_tokens: int, sampling
) -> NamedArray:
    prompt_len = prompt_ids.axis_size(POSITION)
    dtype = model.unembedding().dtype
    cache = model.init_cache(batch_axes_of(prompt_ids), prompt_len + max_new_tokens, dtype)
    logits, cache = model.decode(prompt_ids.astype(jnp.int32), cache, 0)
    first = _sample(logits[POSITION, prompt_len - 1], model, key, 0, sampling)

    def step(carry, i):
        cache, token = carry
        logits, cache = model.decode(_as_one_position(token), cache, prompt_len + i - 1)
        token = _sample(logits[POSITION, 0], model, key, i, sampling)
        return (cache, token), token.array

    _, rest = jax.lax.scan(step, (cache, first), jnp.arange(1, max_new_tokens, dtype=jnp.int32))
    # lax.scan stacks the per-step tokens on a leading dimension; move it to the end, as `position`.
    new = jnp.concatenate([first.array[None], rest], axis=0)
    new = NamedArray(jnp.moveaxis(new, 0, -1), (*first.axes, Axis(POSITION, max_new_tokens)))
    # named-tensors' permute takes `...` (its docstring says so); its annotation does not yet.
    prompt = nt.permute(prompt_ids.astype(jnp.int32), (..., POSITION))
    return nt.concatenate(POSITION, [prompt, new])


@eqx.filter_jit
def _generate_recomputing(
    model: LmHeadModel, prompt_ids: NamedArray, key: jax.Array, max_new_tokens: int, sampling
) -> NamedArray:
    prompt_len = prompt_ids.axis_size(POSITION)
    ids = nt.permute(prompt_ids.astype(jnp.int32), (..., POSITION))
    buffer = nt.pad(ids, {POSITION: (0, max_new_tokens)})

    def step(i, buffer):
        # Causality makes the logits at position t independent of the (still empty) slots after t.
        logits = model(buffer)
        t = prompt_len + i
        token = _sample(nt.take(logits, POSITION, t - 1), model, key, i, sampling)
        return nt.dynamic_update_slice(buffer, _as_one_position(token), {POSITION: t})

    return jax.lax.fori_loop(0, max_new_tokens, step, buffer)
