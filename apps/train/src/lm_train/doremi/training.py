"""`lm-train doremi`: the training kind the shared loop runs, its config checks, and the averaged weights' file."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.sharding import NamedSharding, PartitionSpec

import named_tensors as nt
from lm_train.config.mixture_keys import mixture_schedule
from lm_train.config.schema import TrainLmConfig
from lm_train.data.caches import PreparedData as MixtureData
from lm_train.doremi.objective import doremi_objective
from lm_train.doremi.weights import average_weights, initial_domain_weights
from lm_train.dpo.reference import frozen_reference, load_reference_weights
from lm_train.errors import ConfigError
from lm_train.objectives import Objective
from lm_train.preflight import RunSetup
from lm_train.start import starting_state
from lm_train.state import TrainerState, shapes_of
from lm_train.train_inputs import TrainInputs, mixture_inputs
from lm_train.training_kind import TrainingKind

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


def doremi_starting_state(setup: RunSetup, data: MixtureData) -> tuple[TrainerState, Any]:
    """starting_state with the domain weights (fresh, or restored with the checkpoint) and the frozen reference."""
    if setup.step_settings.microbatches != 1:
        raise ConfigError(
            "trainer.per_device_parallelism: lm-train doremi updates the domain weights from the whole batch at "
            "once, so it cannot accumulate microbatches; set per_device_parallelism to train_batch_size / devices."
        )
    _, trained = _domains(setup.config)
    replicated = NamedSharding(setup.plan.mesh, PartitionSpec())
    initial = jax.device_put(initial_domain_weights(jnp.asarray(trained)), replicated)
    state, target = starting_state(setup, data, objective_state=initial)
    Vocab = nt.Axis("vocab", data.vocab_size())
    model, source = load_reference_weights(setup, Vocab, setup.config.doremi.reference_model_path, REFERENCE_KEY)
    reference = frozen_reference(setup, model)
    if setup.is_main:
        print(f"DoReMi reference model: {source}", file=sys.stderr, flush=True)
    return dataclasses.replace(state, reference=reference), dataclasses.replace(target, reference=shapes_of(reference))


def _inputs(setup: RunSetup, data: MixtureData) -> TrainInputs:
    return mixture_inputs(setup, data, with_sources=True)


def _objective(setup: RunSetup) -> Objective:
    names, trained = _domains(setup.config)
    doremi = setup.config.doremi
    return doremi_objective(names, trained, doremi.step_size, doremi.smoothing)


def averaged_weights(config: TrainLmConfig, state: TrainerState) -> dict[str, float]:
    """The weights averaged over the run's steps, by name (trained domains only)."""
    names, trained = _domains(config)
    average = np.asarray(jax.device_get(average_weights(state.objective_state, int(state.step))))
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


DOREMI = TrainingKind(
    start=doremi_starting_state,
    inputs=_inputs,
    objective=_objective,
    flops_scale=4 / 3,  # the proxy's forward and backward (6N per token) plus the reference's forward (2N)
)
