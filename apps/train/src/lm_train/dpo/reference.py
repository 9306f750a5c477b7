"""DPO's frozen reference model: built the same way on a fresh start and on resume, so that resume is bitwise.

It is the seed's initial model (or initialize_from_hf's weights), or dpo.reference_model_path: an lm-train
checkpoint or a Hugging Face directory. It is kept in the state in the compute dtype, with the model's
shardings, and never checkpointed: it is a pure function of the config.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_train.checkpoints import load_model_weights, resolve_checkpoint
from lm_train.data.caches import PreparedData
from lm_train.errors import ConfigError
from lm_train.preflight import RunSetup
from lm_train.start import starting_state
from lm_train.state import TrainerState, init_model, shapes_of


def _is_hf_directory(path: str) -> bool:
    return "://" not in path and (Path(path).expanduser() / "config.json").is_file()


def _hf_weights(setup: RunSetup, Vocab: nt.Axis, path: str) -> Any:
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
        return _hf_weights(setup, Vocab, path), path
    if "://" not in path and not Path(path).expanduser().exists():
        raise ConfigError(
            f"{key}: {path} does not exist. Give an lm-train checkpoint (or run directory) or a Hugging Face model "
            "directory."
        )
    checkpoint = resolve_checkpoint(path)
    model, _ = load_model_weights(checkpoint, setup.config, setup.plan, Vocab)
    return model, str(checkpoint)


def _source_model(setup: RunSetup, Vocab: nt.Axis) -> tuple[Any, str]:
    """DPO's reference weights in the parameter dtype, and where they came from."""
    config = setup.config
    path = config.dpo.reference_model_path
    if path is None:
        if config.initialize_from_hf:
            return _hf_weights(setup, Vocab, config.initialize_from_hf), config.initialize_from_hf
        return init_model(config, setup.plan, Vocab), "the initial weights"
    return load_reference_weights(setup, Vocab, path, "dpo.reference_model_path")


def frozen_reference(setup: RunSetup, model: Any) -> Any:
    """A model frozen as a reference: in the compute dtype, on the model's shardings, in its own buffers (the
    state is donated to the step, the reference must survive it)."""
    arrays, static = eqx.partition(model, eqx.is_array)
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, arrays)
    policy = setup.policy

    def frozen(params: Any) -> Any:
        return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), policy.cast_to_compute(params))

    return eqx.combine(jax.jit(frozen, out_shardings=shardings)(arrays), static)


def reference_model(setup: RunSetup, Vocab: nt.Axis) -> Any:
    """DPO's frozen reference, in the compute dtype, on the model's shardings."""
    model, source = _source_model(setup, Vocab)
    reference = frozen_reference(setup, model)
    if setup.is_main:
        print(f"DPO reference model: {source}", file=sys.stderr, flush=True)
    return reference


def dpo_starting_state(setup: RunSetup, data: PreparedData) -> tuple[TrainerState, Any]:
    """starting_state (resumed, fresh or from HF), with the reference model attached, and the target with it."""
    state, target = starting_state(setup, data)  # the checkpoint holds no reference: restored without one
    reference = reference_model(setup, nt.Axis("vocab", data.vocab_size()))
    return dataclasses.replace(state, reference=reference), dataclasses.replace(target, reference=shapes_of(reference))
