"""LoRA training: adapters on the base model's linear layers, trained, kept in the optimizer state and
checkpointed alone, while the base weights come from `initialize_from_hf` every time a run starts.

The pieces are plain functions of a model (or of a pytree holding one as `.model`), so that other objectives
(DPO, ...) reuse them: `add_adapters` at init, `split_trainable` in the step, `checkpointed` when saving,
`replace_base` when loading the base, `load_lora_model` for eval, sample and export. Without a `lora`
section each is the identity (or the plain float-array split the step always used), so a full fine-tune
compiles exactly the program it did before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_train.config.lora_config import ALL_LINEAR
from lm_train.config.schema import TrainLmConfig
from lm_train.errors import ConfigError
from lm_train.run.objectives import next_token_objective
from lm_train.run.quantization import load_plain

PURPOSE_LORA_INIT = 3
"""Adapters start from fold_in(run key, 3) (the model's own init uses purpose 0; see lm_train.run.state)."""
_DROPOUT_FOLD = 7  # the adapters' dropout keys: fold_in(step dropout key, 7), apart from the model's own


def lora_settings(config: TrainLmConfig) -> nt.nn.LoraConfig | None:
    """The named-tensors LoRA config of a run (Hugging Face layer names turned into ours), or None."""
    section = config.lora
    if section is None:
        return None
    if section.target_modules is None:
        targets: str | tuple[str, ...] = ALL_LINEAR
    else:
        import hf_bridge

        found = hf_bridge.hf_lora_targets(config.model, section.target_modules)
        targets = found if isinstance(found, str) else tuple(found)
    return nt.nn.LoraConfig(r=section.r, alpha=section.alpha, dropout=section.dropout, target_modules=targets)


def add_adapters(model: Any, config: TrainLmConfig) -> Any:
    """The model with fresh adapters (A random, B zero: the same function) when the config asks for LoRA."""
    settings = lora_settings(config)
    if settings is None:
        return model
    key = jax.random.fold_in(jax.random.key(config.trainer.seed), PURPOSE_LORA_INIT)
    return nt.nn.apply_lora(model, settings, key=key)


def has_adapters(model: Any) -> bool:
    """Whether a model (or a tree of its shapes) has LoRA adapters."""
    return bool(nt.nn.lora_paths(model))


def _floating(_path: str, leaf: Any) -> bool:
    array = leaf.array if nt.is_named(leaf) else leaf
    dtype = getattr(array, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


FLOATING = nt.Filter(_floating, "floating arrays (or their shapes)")
"""Float arrays, also as ShapeDtypeStructs (nt.is_floating takes arrays only)."""


def trainable_spec(model: Any) -> Any:
    """The eqx filter of what the optimizer updates: the adapters alone with LoRA, else every float array."""
    if not has_adapters(model):
        if nt.nn.has_amax_histories(model):  # fp8 scaling state: kept in the model, never trained
            return nt.mask(model, FLOATING & ~nt.nn.amax_histories)
        return eqx.is_inexact_array
    return nt.mask(model, nt.nn.lora_params & FLOATING)


def split_trainable(model: Any) -> tuple[Any, Any]:
    """(trainable arrays, the rest) as eqx.partition gives them; the step differentiates the first."""
    return eqx.partition(model, trainable_spec(model))


def _checkpointed_model(model: Any) -> Any:
    """The model less its frozen base weights: the adapters, every non-float leaf and the fp8 amax histories of
    quantized base layers (state that delayed scaling carries from step to step)."""
    return eqx.filter(model, nt.mask(model, nt.nn.lora_params | ~FLOATING | nt.nn.amax_histories))


def checkpointed(state: Any) -> Any:
    """What is saved of a trainer state (or its shapes): all of it, or, with LoRA, all but the base weights
    (they come from initialize_from_hf), so the checkpoint's size scales with the rank."""
    if not has_adapters(state.model):
        return state
    return eqx.tree_at(lambda s: s.model, state, _checkpointed_model(state.model))


def _is_lora(x: Any) -> bool:
    return isinstance(x, nt.nn.LoraLinear)


def frozen_base(model: Any) -> Any:
    """The base model: each LoraLinear replaced by the Linear it adapts."""
    return jax.tree_util.tree_map(lambda x: x.base if _is_lora(x) else x, model, is_leaf=_is_lora)


def with_base(model: Any, base: Any) -> Any:
    """The LoRA model with the base model's Linears (and every other weight) in place of its own."""

    def pick(ours: Any, theirs: Any) -> Any:
        return eqx.tree_at(lambda layer: layer.base, ours, theirs) if _is_lora(ours) else theirs

    return jax.tree_util.tree_map(pick, model, base, is_leaf=_is_lora)


def replace_base(model: Any, load: Callable[[Any], Any]) -> Any:
    """`load(base model) -> loaded base model`, applied under the adapters (or to the model without LoRA)."""
    if not has_adapters(model):
        return load(model)
    return with_base(model, load(frozen_base(model)))


def with_adapter_dropout(objective: Callable[..., Any]) -> Callable[..., Any]:
    """An objective whose adapters draw their dropout from the step's dropout key (none in evaluation)."""

    def wrapped(model: Any, batch: Any, key: jax.Array | None, frozen: Any = None, kind_state: Any = None) -> Any:
        if key is not None:
            model = nt.nn.with_lora_dropout_keys(model, jax.random.fold_in(key, _DROPOUT_FOLD))
        return objective(model, batch, key, frozen, kind_state)

    return wrapped


def run_objective(config: TrainLmConfig) -> Callable[..., Any] | None:
    """The objective of a run's step: None (the step's own next-token loss) unless LoRA adapters use dropout."""
    if config.lora is None or config.lora.dropout == 0:
        return None
    return with_adapter_dropout(next_token_objective(config.z_loss_weight, config.fcm_prob))


def check_lora_base(config: TrainLmConfig) -> None:
    """LoRA without initialize_from_hf, as a config error (a check of keys only: a kind's config check runs it
    before jax starts anything)."""
    if config.lora is not None and not config.initialize_from_hf:
        raise ConfigError(
            "lora: LoRA trains adapters on a pretrained model, and checkpoints only the adapters: set "
            "initialize_from_hf to the model's Hugging Face directory (e.g. runs/<id>/hf/step-N of a run)."
        )


def check_lora(config: TrainLmConfig) -> None:
    """LoRA settings that cannot work, as a config error (shapes only: nothing is allocated)."""
    if config.lora is None:
        return
    check_lora_base(config)
    Vocab = nt.Axis("vocab", config.data.vocab_size)
    try:
        jax.eval_shape(lambda: add_adapters(config.model.build(Vocab, key=jax.random.key(0)), config))
    except ValueError as e:
        raise ConfigError(f"lora.target_modules: {e}") from None


def lora_base_as_absolute_path(config: TrainLmConfig) -> TrainLmConfig:
    """A LoRA run's config with a relative local initialize_from_hf made absolute: its checkpoints hold the
    adapters alone, and eval, sample and export (from any directory) load the base from this path."""
    if config.lora is None or not config.initialize_from_hf:
        return config
    source = config.hf_directory()
    if "://" in source or not Path(source).expanduser().exists():
        return config
    return dataclasses.replace(config, initialize_from_hf=str(Path(source).expanduser().resolve()))


def load_lora_model(checkpoint: Path | str, config: TrainLmConfig, plan: Any, shapes: Any, *, progress: bool) -> Any:
    """A LoRA run's model: adapters from its checkpoint, base weights from its initialize_from_hf."""
    import dist_ckpt
    import hf_bridge

    adapters = dist_ckpt.load(checkpoint, _checkpointed_model(shapes), subtree=".model", progress=progress)
    base = load_plain(  # quantized base Linears load as plain ones; their histories come with the adapters
        frozen_base(shapes),
        lambda plain: hf_bridge.load_weights(
            config.hf_directory(), plain, mesh=plan.mesh, axis_mapping=plan.param_mapping
        ),
    )
    return eqx.combine(adapters, with_base(shapes, base))


def merged(model: Any) -> Any:
    """The model with its adapters folded into the base weights (a plain model of the base's structure)."""
    return nt.nn.merge_lora(model) if has_adapters(model) else model
