"""The state a run starts from: its newest checkpoint, a fresh init, or a fresh init with Hugging Face weights."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import equinox as eqx
import jax

import named_tensors as nt
from lm_train.config.loading import dump_config
from lm_train.data.caches import PreparedData
from lm_train.data.tokenizer import tokenizer_bytes
from lm_train.post.lora_training import checkpointed, has_adapters, replace_base
from lm_train.run.checkpoints import restore_newest_intact
from lm_train.run.model_averaging import initial_average
from lm_train.run.preflight import RunSetup
from lm_train.run.quantization import load_plain
from lm_train.run.run_dir import write_run_files
from lm_train.run.state import TrainerState, init_state, shapes_of, state_shapes


def _say(setup: RunSetup, text: str) -> None:
    if setup.is_main:
        print(text, file=sys.stderr, flush=True)


def _initialize_from_hf(state: TrainerState, setup: RunSetup, target: TrainerState) -> TrainerState:
    """Replace a fresh state's parameters with a Hugging Face checkpoint's (continued pretraining)."""
    import hf_bridge

    path = setup.config.hf_directory()
    plan = setup.plan

    def load(base: Any) -> Any:  # a quantized Linear loads its weights as a plain one and keeps its matmul
        return load_plain(
            base, lambda b: hf_bridge.load_weights(path, b, mesh=plan.mesh, axis_mapping=plan.param_mapping)
        )

    model = replace_base(state.model, load)  # with LoRA, the weights go under the adapters
    model = jax.device_put(model, jax.tree_util.tree_map(lambda s: s.sharding, target.model))
    _say(setup, f"initialized the model from {path}")
    if state.averaged is not None:  # the average starts from the weights trained from
        state = dataclasses.replace(state, averaged=initial_average(model))
    return eqx.tree_at(lambda s: s.model, state, model)


def starting_state(setup: RunSetup, data: PreparedData, kind_state: Any = None) -> tuple[TrainerState, Any]:
    """The state to train from, on its sharded layout, and that layout's target shapes.

    `kind_state`: the initial value of a kind's checkpointed state (a mixture's domain weights), placed on
    devices; a resumed run restores it from the checkpoint instead.
    """
    Vocab = nt.Axis("vocab", data.vocab_size())
    target = state_shapes(setup.config, setup.plan, Vocab, setup.optimizer)
    if kind_state is not None:
        target = dataclasses.replace(target, kind_state=shapes_of(kind_state))
    lora = has_adapters(target.model)
    if setup.resume_from is not None and not lora:
        state, path = restore_newest_intact(setup.resume_from, target, setup.config, setup.paths, is_main=setup.is_main)
        _say(setup, f"resuming from {path}")
        return state, target
    state = init_state(setup.config, setup.plan, Vocab, setup.optimizer)
    if kind_state is not None:
        state = dataclasses.replace(state, kind_state=kind_state)
    if setup.config.initialize_from_hf:
        state = _initialize_from_hf(state, setup, target)
    if setup.resume_from is not None:  # LoRA: the checkpoint holds all but the base weights just loaded
        saved, path = restore_newest_intact(
            setup.resume_from, checkpointed(target), setup.config, setup.paths, is_main=setup.is_main
        )
        state = eqx.combine(saved, state)
        _say(setup, f"resuming from {path}")
    return state, target


def write_run_dir(setup: RunSetup, data: PreparedData) -> None:
    """config.yaml and tokenizer.json, so that the run directory alone serves eval, sample and export.

    Written once the starting state is known to fit: a bad rerun leaves the run directory as it was.
    """
    if not setup.is_main:
        return
    paths = setup.paths
    paths.create()
    config_text, tokenizer = dump_config(setup.config), tokenizer_bytes(data.tokenizer_path)
    write_run_files(str(paths.run_dir), config_text, tokenizer)
    if setup.config.trainer.checkpointer.base_path:
        paths.describe_checkpoint_root(setup.config.trainer.checkpointer.base_path, config_text, tokenizer)
