"""A LoRA model's adapters as a PEFT adapter directory, written once by process 0."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

import hf_bridge
import named_tensors as nt
from lm_train.config.schema import TrainLmConfig
from lm_train.post.lora_training import FLOATING


def _adapters_on_every_host(model: Any) -> Any:
    """The model with its adapters as whole host arrays on every process (they are small); the base untouched."""
    if jax.process_count() == 1:
        return model
    from jax.experimental import multihost_utils

    adapters, rest = eqx.partition(model, nt.mask(model, nt.nn.lora_params & FLOATING))
    return eqx.combine(multihost_utils.process_allgather(adapters, tiled=True), rest)


def export_adapter(model: Any, config: TrainLmConfig, out_dir: str, *, overwrite: bool) -> None:
    """Write adapter_config.json + adapter_model.safetensors that peft.PeftModel.from_pretrained(base, out_dir)
    loads onto the base model of `initialize_from_hf` (every process must call this)."""
    model = _adapters_on_every_host(model)
    if jax.process_index() == 0:
        hf_bridge.save_peft_adapter(
            model, config.model, out_dir, base_model_name_or_path=config.hf_directory(), overwrite=overwrite
        )
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"peft adapter {out_dir}")
