"""The table of training kinds: each row loads its TrainingKind, its command is generated from the row, and a
kind's batch fields reach the step with their dtypes and axes."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

import named_tensors as nt
from lm_train.cli import app
from lm_train.cli.kind_commands import with_key
from lm_train.kinds import KINDS, kind_entry
from lm_train.run.batch import CORE_FIELDS, as_host_batch, named_batch
from lm_train.run.training_kind import TrainingKind


def test_every_row_loads_a_kind_of_its_command():
    assert [entry.command for entry in KINDS] == ["run", "dpo", "doremi", "rl"]
    for entry in KINDS:
        kind = entry.load()
        assert isinstance(kind, TrainingKind) and kind.command == entry.command
        assert kind.name == f"lm-train {entry.command}"
        assert set(CORE_FIELDS) <= set(kind.fields) and not set(kind.extra_fields) & set(CORE_FIELDS)
    assert kind_entry("dpo").load().frozen_model is not None and kind_entry("run").load().frozen_model is None
    assert kind_entry("doremi").load().initial_kind_state is not None
    with pytest.raises(KeyError, match="run"):
        kind_entry("grpo")


@pytest.mark.parametrize("entry", KINDS, ids=lambda e: e.command)
def test_each_command_is_generated_from_its_row(entry):
    result = CliRunner().invoke(app, [entry.command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert " ".join(entry.help.split()) in " ".join(result.output.split())
    for flag in (
        "--coordinator-address",
        "--num-processes",
        "--process-id",
        "--debug",
        *(o.flag for o in entry.options),
    ):
        assert flag in result.output


def test_a_kinds_option_sets_its_config_key(make_config):
    config = make_config()
    changed = with_key(config, "doremi.reference_model_path", "runs/ref")
    assert changed.doremi.reference_model_path == "runs/ref" and config.doremi.reference_model_path is None
    assert changed.trainer == config.trainer


def test_a_kinds_fields_reach_the_step_with_their_dtypes_and_axes():
    doremi = kind_entry("doremi").load()
    ids = np.arange(12, dtype=np.int64).reshape(3, 4)
    host = as_host_batch({"input_ids": ids, "source_ids": [2, 0, 1]}, doremi.fields)
    assert host["input_ids"].dtype == np.int32 and host["source_ids"].dtype == np.int32
    batch = named_batch(host, "batch", nt.Axis("position", 4), doremi.fields)
    assert batch.extra["source_ids"].axes == (nt.Axis("batch", 3),)  # one per example
    assert batch.input_ids.axes == (nt.Axis("batch", 3), nt.Axis("position", 4))
    np.testing.assert_array_equal(np.asarray(batch.extra["source_ids"].array), [2, 0, 1])
    with pytest.raises(ValueError, match=r"unknown batch fields \['source_ids'\]"):
        as_host_batch({"input_ids": ids, "source_ids": [2, 0, 1]})  # a plain run's batch has no domains
