"""`lm-train sample`: continue a prompt with a trained checkpoint."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_models import generate
from lm_train.checkpoint_io import load_model
from lm_train.errors import UserError


def sample_checkpoint(
    checkpoint: Path,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
) -> str:
    """The prompt followed by up to max_new_tokens generated tokens, decoded to text."""
    loaded = load_model(checkpoint)
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False).ids
    if not ids:
        raise UserError("--prompt is empty after tokenization; give some text to continue.")
    limit = loaded.config.model.Pos.size
    if len(ids) + max_new_tokens > limit:
        raise UserError(
            f"prompt ({len(ids)} tokens) + --max-new-tokens ({max_new_tokens}) exceeds the model's seq_len "
            f"({limit}); shorten one of them."
        )
    if temperature < 0:
        raise UserError("--temperature must be >= 0 (0 means greedy).")
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
