"""`lm-train sample`: continue a prompt with a trained checkpoint (KV-cache generation)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_models import generate
from lm_train.errors import UserError
from lm_train.run.checkpoints import load_model
from lm_train.run.model_averaging import check_weights


def check_sampling_options(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Reject bad sampling options before any model is loaded."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
    if temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0 means greedy), got {temperature}.")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {top_k}; leave it out to sample from every token.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise UserError(f"--top-p must be in (0, 1], got {top_p}; e.g. --top-p 0.9, or leave it out.")


def sample_checkpoint(
    checkpoint: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    weights: str | None = None,
) -> str:
    """The prompt followed by up to max_new_tokens generated tokens, decoded to text; `weights`: the checkpoint's
    `ema` or `raw` weights (None: the run's choice)."""
    check_sampling_options(max_new_tokens, temperature, top_k, top_p)
    check_weights(weights)
    loaded = load_model(checkpoint, weights)
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False).ids
    if not ids:
        raise UserError("--prompt is empty after tokenization; give some text to continue.")
    limit = loaded.config.model.Pos.size
    if len(ids) + max_new_tokens > limit:
        raise UserError(
            f"prompt ({len(ids)} tokens) + --max-new-tokens ({max_new_tokens}) exceeds the model's seq_len "
            f"({limit}); shorten one of them."
        )
    prompt_ids = nt.named(jnp.asarray(ids, jnp.int32), ("position",))
    tokens = generate(
        loaded.model,
        prompt_ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        key=jax.random.key(seed) if temperature > 0 else None,
    )
    return loaded.tokenizer.decode([int(t) for t in tokens.array.tolist()])
