"""A frozen reference model beside the trained one (DPO's, DoReMi's): its weights loaded, then frozen in the compute
dtype. It is a pure function of the config, so a kind rebuilds it the same way on a fresh start and on resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_train.errors import ConfigError
from lm_train.run.checkpoints import load_model_weights, resolve_checkpoint
from lm_train.run.preflight import RunSetup
from lm_train.run.state import init_model


def _is_hf_directory(path: str) -> bool:
    return "://" not in path and (Path(path).expanduser() / "config.json").is_file()


def hf_weights(setup: RunSetup, Vocab: nt.Axis, path: str) -> Any:
    """A Hugging Face directory's weights in the run's model structure, on the model's shardings."""
    import hf_bridge

    model = init_model(setup.config, setup.plan, Vocab)  # the structure and layout to load into
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, eqx.filter(model, eqx.is_array))
    loaded = hf_bridge.load_weights(path, model, mesh=setup.plan.mesh, axis_mapping=setup.plan.param_mapping)
    arrays, static = eqx.partition(loaded, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, shardings), static)


def load_reference_weights(setup: RunSetup, Vocab: nt.Axis, path: str, key: str) -> tuple[Any, str]:
    """A reference model's weights from `path` (an lm-train checkpoint or run directory, or a Hugging Face
    directory), in the parameter dtype, and where they came from; `key` names the setting in errors."""
    if _is_hf_directory(path):
        return hf_weights(setup, Vocab, path), path
    if "://" not in path and not Path(path).expanduser().exists():
        raise ConfigError(
            f"{key}: {path} does not exist. Give an lm-train checkpoint (or run directory) or a Hugging Face model "
            "directory."
        )
    checkpoint = resolve_checkpoint(path)
    model, _ = load_model_weights(checkpoint, setup.config, setup.plan, Vocab)
    return model, str(checkpoint)


def frozen_reference(setup: RunSetup, model: Any) -> Any:
    """A model frozen as a reference: in the compute dtype, on the model's shardings, in its own buffers (the
    state is donated to the step, the reference must survive it)."""
    arrays, static = eqx.partition(model, eqx.is_array)
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, arrays)
    policy = setup.policy

    def frozen(params: Any) -> Any:
        return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), policy.cast_to_compute(params))

    return eqx.combine(jax.jit(frozen, out_shardings=shardings)(arrays), static)
