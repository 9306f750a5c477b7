"""Quantized training in the run: fp8/int8 matmuls set on the model, and the step's handling of fp8 amax histories.

The histories are arrays of the model (so the state and its checkpoints hold them, and a resumed run scales
exactly as the first did) but no trainable parameters: `split_trainable` leaves them out of what the optimizer
sees, the step differentiates them beside the parameters only to receive the amaxes each layer saw (their
"gradients", see named_tensors.nn.quantized_matmul), and `record_amax` rolls them forward after the update.
A model without histories takes none of these paths: its step compiles the program it always did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_train.config.quantization_config import QuantizationConfig
from lm_train.errors import ConfigError


def quantize_model(model: Any, quantization: QuantizationConfig | None) -> Any:
    """The model with the section's targeted Linear layers in fp8 or int8 (unchanged without one)."""
    if quantization is None or quantization.mode is None:
        return model
    try:
        return nt.nn.quantize_linears(
            model,
            quantization.mode,
            quantization.target_layers(),
            scaling=quantization.scaling,
            history_length=quantization.amax_history_length,
        )
    except ValueError as e:
        raise ConfigError(f"trainer.quantization.targets: {e}") from None


def _is_linear(x: Any) -> bool:
    return isinstance(x, nt.nn.Linear)


def load_plain(model: Any, load: Callable[[Any], Any]) -> Any:
    """load(model) for a loader of plain Linear weights (a Hugging Face checkpoint): the quantized matmuls, amax
    histories included, are taken off for the load and put back on the loaded weights."""
    plain = nt.nn.plain_linears(model)
    loaded = load(plain)
    if jax.tree_util.tree_structure(plain) == jax.tree_util.tree_structure(model):
        return loaded  # nothing was quantized

    def put_back(new: Any, old: Any) -> Any:
        if not _is_linear(new):
            return new
        return nt.nn.Linear(new.weight, new.bias, new.In, new.Out, old.quant)

    return jax.tree_util.tree_map(put_back, loaded, model, is_leaf=_is_linear)


def check_quantization(model_shapes: Any, quantization: QuantizationConfig | None) -> None:
    """The section's targets name Linear layers of the model (shapes only)."""
    if quantization is None or quantization.mode is None:
        return
    jax.eval_shape(lambda: quantize_model(model_shapes, quantization))


def _split(tree: Any) -> tuple[Any, Any]:
    # eqx.partition, not nt.partition: both halves keep the tree's NamedArrays (with None inside), so they
    # combine with split_trainable's halves.
    return eqx.partition(tree, nt.mask(tree, nt.nn.amax_histories))


def split_histories(static: Any) -> tuple[Any, Any]:
    """(the amax histories, the rest) of the step's non-trainable part; (None, static) when it keeps none."""
    if not nt.nn.has_amax_histories(static):
        return None, static
    return _split(static)


def add_grads(total: Any, new: Any) -> Any:
    """Microbatches' gradients summed, and the amaxes they saw (the histories' entries) maxed."""
    if not nt.nn.has_amax_histories(total):
        return jax.tree_util.tree_map(jnp.add, total, new)
    seen_total, grads_total = _split(total)
    seen_new, grads_new = _split(new)
    summed = jax.tree_util.tree_map(jnp.add, grads_total, grads_new)
    return eqx.combine(summed, jax.tree_util.tree_map(jnp.maximum, seen_total, seen_new))


def mean_grads(total: Any, n: int) -> Any:
    """The summed gradients over n microbatches averaged; the amaxes seen stay the max they are."""
    if not nt.nn.has_amax_histories(total):
        return jax.tree_util.tree_map(lambda g: g / n, total)
    seen, grads = _split(total)
    return eqx.combine(jax.tree_util.tree_map(lambda g: g / n, grads), seen)


def split_seen(grads: Any, histories: Any) -> tuple[Any, Any]:
    """(the parameters' gradients, the amaxes each history saw); without histories (grads, None)."""
    if histories is None:
        return grads, None
    seen, rest = _split(grads)
    return rest, seen


def combine_model(params: Any, static: Any, histories: Any, seen: Any) -> Any:
    """The step's new model: its parameters, the rest, and the histories rolled forward with the amaxes seen."""
    if histories is None:
        return eqx.combine(params, static)
    return eqx.combine(params, static, nt.nn.record_amax(histories, seen))
