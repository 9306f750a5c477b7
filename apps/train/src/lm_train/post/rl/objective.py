"""GRPO's advantages (group-relative rewards, on the host) and its clipped policy-gradient objective (in the step),
with the sampler's log-probs as the old policy and an optional KL penalty to the frozen reference."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import named_tensors as nt
from lm_models import inference_mode, next_token_loss
from lm_train.post.lora_training import frozen_base, has_adapters
from lm_train.run.batch import TokenBatch
from lm_train.run.objectives import Metrics, Objective

ADVANTAGE, OLD_LOGPROB = "rl_advantage", "rl_old_logprob"
"""The batch fields RL adds: each completion's advantage, and the sampler's log-prob of each sampled token."""
FRESH = "rl_fresh"
"""With several updates per batch of completions: 1 where the rows are trained on by the weights that sampled them
(the batch's first update), 0 on later updates, whose ratios measure how far the policy has moved."""

RL_METRICS = ("rl/kl", "rl/clip_fraction", "rl/logprob_mismatch")


def group_advantages(rewards: np.ndarray, group_size: int, scale_by_std: bool) -> np.ndarray:
    """Each completion's reward minus its group's mean (divided by the group's spread where `scale_by_std`);
    rewards are (B * G,), the G completions of a prompt next to each other."""
    groups = rewards.reshape(-1, group_size).astype(np.float64)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if scale_by_std:
        centred = centred / (groups.std(axis=1, keepdims=True) + 1e-6)
    return centred.reshape(-1).astype(np.float32)


def token_log_probs(model: Any, input_ids: nt.NamedArray, loss_mask: nt.NamedArray, key: jax.Array | None = None):
    """log p(token t + 1 | tokens ..t) at each position t that loss_mask selects (0 elsewhere), as an array laid out
    like input_ids. The sampler's rescoring and the objective both call this, so their log-probs agree."""
    nll = next_token_loss(model, input_ids, loss_mask=loss_mask, key=key, reduction=None)
    return -nt.permute(nll, tuple(a.name for a in input_ids.axes)).array.astype(jnp.float32)


def _field(batch: TokenBatch, name: str) -> jax.Array:
    value = batch.extra.get(name)
    if value is None:
        raise ValueError(f"an RL batch needs the field {name!r}")
    return value.array


def rl_objective(loss: str, clip_epsilon: float, kl_coef: float, max_new_tokens: int) -> Objective:
    """The clipped policy-gradient objective of `loss` (grpo, dr_grpo or gspo) plus kl_coef times the KL to the
    frozen reference (k3 estimator, mean over completion tokens), logging RL_METRICS. With LoRA the reference is the
    policy's own base model, its adapters left out (no second copy of the weights)."""

    def objective(
        model: Any, batch: TokenBatch, key: jax.Array | None, frozen: Any = None, kind_state: Any = None
    ) -> tuple[jax.Array, Metrics, Any]:
        if frozen is None and has_adapters(model):
            frozen = frozen_base(model)  # the base weights are not trained: no gradient flows into them
        if batch.loss_mask is None or frozen is None:
            raise ValueError("RL's objective needs the batch's loss_mask and the frozen reference (the state's)")
        mask = batch.loss_mask.array.astype(jnp.float32)
        advantage = _field(batch, ADVANTAGE).astype(jnp.float32)
        old = _field(batch, OLD_LOGPROB)
        new = token_log_probs(model, batch.input_ids, batch.loss_mask, key)
        tokens = jnp.maximum(jnp.sum(mask), 1.0)
        per_sequence = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
        delta = (new - old) * mask
        low, high = 1.0 - clip_epsilon, 1.0 + clip_epsilon
        if loss == "gspo":
            # GSPO: one importance ratio per completion, the geometric mean of its tokens' ratios.
            ratio = jnp.exp(jnp.sum(delta, axis=-1) / per_sequence)
            surrogate = jnp.minimum(ratio * advantage, jnp.clip(ratio, low, high) * advantage)
            pg_loss = -jnp.mean(surrogate)
            clipped = jnp.mean((jnp.abs(ratio - 1.0) > clip_epsilon).astype(jnp.float32))
        else:
            ratio = jnp.exp(delta)
            a = advantage[:, None]
            surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, low, high) * a) * mask
            if loss == "grpo":  # each completion's tokens averaged, then the completions
                pg_loss = -jnp.mean(jnp.sum(surrogate, axis=-1) / per_sequence)
            else:  # dr_grpo: a constant denominator, so long completions are not favoured or penalised
                pg_loss = -jnp.sum(surrogate) / (mask.shape[0] * max_new_tokens)
            clipped = jnp.sum((jnp.abs(ratio - 1.0) > clip_epsilon).astype(jnp.float32) * mask) / tokens
        reference = jax.lax.stop_gradient(token_log_probs(inference_mode(frozen), batch.input_ids, batch.loss_mask))
        log_ratio = (reference - new) * mask
        kl = jnp.sum((jnp.exp(log_ratio) - log_ratio - 1.0) * mask) / tokens
        total = pg_loss + kl_coef * kl if kl_coef else pg_loss
        drift = jnp.abs(delta)
        if FRESH in batch.extra:  # later updates of a batch are off-policy on purpose: only the first one is measured
            drift = drift * _field(batch, FRESH)[:, None]
        mismatch = jnp.max(drift)  # the sampler's log-probs against this step's, over sampled tokens
        values = (kl, clipped, mismatch)
        metrics = {name: jax.lax.stop_gradient(v) for name, v in zip(RL_METRICS, values, strict=True)}
        return total.astype(jnp.float32), metrics, kind_state

    return objective
