"""Model averaging: the EMA of the trainable weights that the trainer state keeps, its update, its model, and
which of a checkpoint's two sets of weights (`--weights ema|raw`) a tool uses."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from lm_train.errors import CheckpointError, UserError
from lm_train.post.lora_training import split_trainable

WEIGHTS = ("ema", "raw")
"""The weights of a checkpoint a tool can use: its weight average (`ema`) or the trained weights (`raw`)."""
AVERAGED = ".averaged"
"""The key path of the trainer state's weight average in a checkpoint."""


def _map(fn: Any, *trees: Any) -> Any:
    # None marks a leaf left out of the trainable tree (frozen base weights under LoRA): it stays None.
    return jax.tree_util.tree_map(lambda *xs: None if xs[0] is None else fn(*xs), *trees, is_leaf=lambda x: x is None)


def initial_average(model: Any) -> Any:
    """The average at the start: a copy of the model's trainable weights (its own buffers, so both can be donated)."""
    params, _ = split_trainable(model)
    return _map(lambda p: jnp.array(p, copy=True), params)


def ema_update(average: Any, params: Any, beta: float) -> Any:
    """beta * average + (1 - beta) * params, leaf by leaf, in the average's dtype."""
    return _map(lambda a, p: (beta * a + (1.0 - beta) * p.astype(a.dtype)).astype(a.dtype), average, params)


def averaged_model(model: Any, average: Any) -> Any:
    """The model with its trainable weights replaced by their average."""
    _, static = split_trainable(model)
    return eqx.combine(average, static)


def exported_model(state: Any, averaging: Any) -> Any:
    """The model a run exports: its weight average when it keeps one and `export_ema` says so, else its own."""
    if state.averaged is None or averaging is None or not averaging.export_ema:
        return state.model
    return averaged_model(state.model, state.averaged)


def check_weights(weights: str | None) -> None:
    """A UserError unless `weights` is None (the run's choice) or one of WEIGHTS; before anything is loaded."""
    if weights is not None and weights not in WEIGHTS:
        raise UserError(
            f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}: `ema` uses the checkpoint's weight "
            "average (trainer.model_averaging), `raw` the trained weights; leave it out for the run's choice."
        )


def keeps_average(manifest: dict[str, Any]) -> bool:
    """Whether a checkpoint (its dist_ckpt manifest) holds a weight average."""
    return any(entry["path"][: len(AVERAGED) + 1] in (AVERAGED, AVERAGED + ".") for entry in manifest["leaves"])


def chosen_weights(weights: str | None, checkpoint: Any, manifest: dict[str, Any], averaging: Any) -> str:
    """`ema` or `raw`: `weights` where given (a CheckpointError for `ema` on a checkpoint without an average),
    else the weights the run's own exports hold: the average where it keeps one and `export_ema` is on."""
    check_weights(weights)
    kept = keeps_average(manifest)
    if weights == "ema" and not kept:
        raise CheckpointError(
            f"--weights ema: checkpoint {checkpoint} holds no weight average (its run had no "
            "trainer.model_averaging); use --weights raw, or leave --weights out."
        )
    if weights is not None:
        return weights
    return "ema" if kept and averaging is not None and averaging.export_ema else "raw"
