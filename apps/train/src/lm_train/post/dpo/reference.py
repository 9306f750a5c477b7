"""DPO's frozen reference model: the seed's initial model (or initialize_from_hf's weights), or
dpo.reference_model_path: an lm-train checkpoint or a Hugging Face directory (post.reference_model freezes it)."""

from __future__ import annotations

import sys
from typing import Any

import named_tensors as nt
from lm_train.post.reference_model import frozen_reference, hf_weights, load_reference_weights
from lm_train.run.preflight import RunSetup
from lm_train.run.state import init_model


def _source_model(setup: RunSetup, Vocab: nt.Axis) -> tuple[Any, str]:
    """DPO's reference weights in the parameter dtype, and where they came from."""
    config = setup.config
    path = config.dpo.reference_model_path
    if path is None:
        if config.initialize_from_hf:
            source = config.hf_directory()
            return hf_weights(setup, Vocab, source), source
        return init_model(config, setup.plan, Vocab), "the initial weights"
    return load_reference_weights(setup, Vocab, path, "dpo.reference_model_path")


def reference_model(setup: RunSetup, Vocab: nt.Axis) -> Any:
    """DPO's frozen reference, in the compute dtype, on the model's shardings."""
    model, source = _source_model(setup, Vocab)
    reference = frozen_reference(setup, model)
    if setup.is_main:
        print(f"DPO reference model: {source}", file=sys.stderr, flush=True)
    return reference
