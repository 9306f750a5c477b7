"""`lm-train doremi`: the training kind the shared loop runs, its config checks, and the averaged weights' file."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml

import named_tensors as nt
from lm_train.config.mixture_keys import mixture_schedule
from lm_train.config.schema import TrainLmConfig
from lm_train.data.caches import PreparedData as MixtureData
from lm_train.errors import ConfigError
from lm_train.language_modeling import prepare_text_data
from lm_train.post.doremi.objective import doremi_objective
from lm_train.post.doremi.weights import DomainWeights, average_weights, initial_domain_weights
from lm_train.post.reference_model import frozen_reference, load_reference_weights
from lm_train.run.batch import BatchField
from lm_train.run.objectives import Objective
from lm_train.run.preflight import RunSetup
from lm_train.run.state import TrainerState
from lm_train.run.train_inputs import TrainInputs, mixture_inputs
from lm_train.run.training_kind import TrainingKind

WEIGHTS_FILE = "doremi_weights.yaml"
"""In the run directory at the end: the averaged weights, as a config file `lm-train run` takes beside the base."""
REFERENCE_KEY = "doremi.reference_model_path (lm-train doremi --reference)"


def check_doremi_config(config: TrainLmConfig) -> None:
    """What DoReMi needs of the rest of the config, checked before anything is started."""
    if not config.data.configs:
        raise ConfigError(
            "data.configs is empty: lm-train doremi reweights the domains of a mixture. Give data.configs "
            "{name: source, ...} with two or more sources, and data.train_weights (uniform: all 1) to sample them."
        )
    schedule = mixture_schedule(config.data)  # every mixture key checked, naming the key
    if len(schedule.trained()) < 2:
        raise ConfigError(
            f"data.train_weights: lm-train doremi needs two or more trained domains; only {list(schedule.trained())} "
            "has a positive weight. Give the others a weight (uniform: all 1)."
        )
    path = config.doremi.reference_model_path
    if not path:
        raise ConfigError(
            "lm-train doremi needs a reference model: pass --reference CHECKPOINT (a checkpoint or run directory of "
            "the same model trained on this mixture with `lm-train run`), or set doremi.reference_model_path."
        )
    if "://" not in path and not Path(path).expanduser().exists():
        raise ConfigError(
            f"{REFERENCE_KEY}: {path} does not exist. Give a checkpoint or run directory of lm-train run."
        )


def _domains(config: TrainLmConfig) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    schedule = mixture_schedule(config.data)
    trained = set(schedule.trained())
    return schedule.names, tuple(name in trained for name in schedule.names)


def _initial_weights(config: TrainLmConfig) -> DomainWeights:
    _, trained = _domains(config)
    return initial_domain_weights(jnp.asarray(trained))


def _reference(setup: RunSetup, Vocab: nt.Axis) -> Any:
    """The frozen reference the proxy's excess losses are measured against."""
    path = setup.config.doremi.reference_model_path
    assert path is not None  # the kind's config check refuses a DoReMi config without one
    model, source = load_reference_weights(setup, Vocab, path, REFERENCE_KEY)
    reference = frozen_reference(setup, model)
    if setup.is_main:
        print(f"DoReMi reference model: {source}", file=sys.stderr, flush=True)
    return reference


def _inputs(setup: RunSetup, data: MixtureData) -> TrainInputs:
    return mixture_inputs(setup, data, with_sources=True)


def _objective(config: TrainLmConfig) -> Objective:
    names, trained = _domains(config)
    return doremi_objective(names, trained, config.doremi.step_size, config.doremi.smoothing)


def _fields(config: TrainLmConfig) -> tuple[str, ...]:
    return ("input_ids", "source_ids")


def averaged_weights(config: TrainLmConfig, state: TrainerState) -> dict[str, float]:
    """The weights averaged over the run's steps, by name (trained domains only)."""
    names, trained = _domains(config)
    average = np.asarray(jax.device_get(average_weights(state.kind_state, int(state.step))))
    return {name: float(w) for name, w, t in zip(names, average, trained, strict=True) if t}


def write_weights_file(config: TrainLmConfig, state: TrainerState, run_dir: Path) -> Path:
    """`data: {train_weights: {...}}`, the averaged weights, written atomically: `lm-train run base.yaml this.yaml`."""
    path = Path(run_dir) / WEIGHTS_FILE
    body = {"data": {"train_weights": averaged_weights(config, state)}}
    note = f"# DoReMi's domain weights averaged over {int(state.step)} steps: lm-train run BASE.yaml {WEIGHTS_FILE}\n"
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(note + yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    os.replace(temporary, path)
    return path


def _finish(config: TrainLmConfig, result: Any) -> None:
    path = write_weights_file(config, result.state, result.paths.run_dir)
    print(f"DoReMi's averaged domain weights: {path}", file=sys.stderr, flush=True)


DOREMI = TrainingKind(
    command="doremi",
    prepare_data=prepare_text_data,  # the mixture's caches, as `lm-train run` prepares them
    inputs=_inputs,
    objective=_objective,
    batch_fields=_fields,
    extra_fields={"source_ids": BatchField(np.int32, per_token=False)},  # each example's domain
    check_config=check_doremi_config,
    initial_kind_state=_initial_weights,
    frozen_model=_reference,
    finish=_finish,
    flops_scale=4 / 3,  # the proxy's forward and backward (6N per token) plus the reference's forward (2N)
    plan_note="a mixture's domains, and a frozen reference model",
    frozen_label=("reference model", "(DoReMi's, frozen, compute dtype)"),
)
