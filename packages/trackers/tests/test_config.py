"""Tracker configs: registry by type, clear errors for bad input, building, process 0 rule."""

from __future__ import annotations

import dataclasses
import json

import pytest

import trackers


def test_from_dict_selects_the_registered_class_and_round_trips():
    config = trackers.tracker_config_from_dict(
        {"type": "wandb", "project": "p", "tags": ["x", "y"], "mode": "offline", "resume": "allow"}
    )
    assert isinstance(config, trackers.WandbConfig)
    assert config.tags == ("x", "y")
    assert config.to_dict()["tags"] == ["x", "y"]
    assert trackers.tracker_config_from_dict(config.to_dict()) == config
    assert hash(config) == hash(trackers.tracker_config_from_dict(config.to_dict()))
    assert set(trackers.tracker_config_types()) == {"wandb", "tensorboard", "jsonl", "console", "noop"}


def test_configs_are_plain_frozen_dataclasses():
    config = trackers.JsonlConfig(path="m.jsonl")
    assert dataclasses.is_dataclass(config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.path = "other.jsonl"
    assert config.type == "jsonl"


def test_a_list_or_null_from_yaml():
    configs = trackers.tracker_configs_from_value([{"type": "jsonl"}, {"type": "tensorboard", "logdir": "tb"}])
    assert configs == (trackers.JsonlConfig(), trackers.TensorboardConfig(logdir="tb"))
    assert trackers.tracker_configs_from_value({"type": "noop"}) == (trackers.NoopConfig(),)
    assert trackers.tracker_configs_from_value(None) == ()


def test_unknown_type_suggests_the_nearest():
    with pytest.raises(trackers.TrackerConfigError) as caught:
        trackers.tracker_config_from_dict({"type": "wandbb"}, where="trainer.tracker")
    message = str(caught.value)
    assert "trainer.tracker: unknown tracker type 'wandbb'. Did you mean 'wandb'?" in message
    assert "Valid types: console, jsonl, noop, tensorboard, wandb." in message


def test_unknown_key_suggests_the_nearest_and_names_the_list_index():
    with pytest.raises(trackers.TrackerConfigError) as caught:
        trackers.tracker_configs_from_value(
            [{"type": "jsonl"}, {"type": "wandb", "projet": "p"}], where="trainer.tracker"
        )
    message = str(caught.value)
    assert "trainer.tracker[1]: unknown key 'projet' for tracker type 'wandb'. Did you mean 'project'?" in message
    assert "Valid keys: type, all_processes, project," in message


def test_missing_type_and_wrong_shapes():
    with pytest.raises(trackers.TrackerConfigError, match=r"has no 'type' key; add one of console, jsonl"):
        trackers.tracker_config_from_dict({"project": "p"})
    with pytest.raises(trackers.TrackerConfigError, match=r"tracker must be a tracker mapping or a list"):
        trackers.tracker_configs_from_value("wandb")


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (
            {"type": "wandb", "tags": "solo"},
            r"tracker \(type 'wandb'\): key 'tags' must be a list of strings, got 'solo' \(str\)",
        ),
        (
            {"type": "wandb", "mode": "offlin"},
            r"key 'mode' must be one of 'online', 'offline', 'disabled' or null, got 'offlin' \(str\)\. "
            r"Did you mean 'offline'\?",
        ),
        ({"type": "console", "precision": "4"}, r"key 'precision' must be an integer, got '4' \(str\)"),
        ({"type": "jsonl", "all_processes": 1}, r"key 'all_processes' must be true or false"),
    ],
)
def test_values_of_the_wrong_kind_name_the_key(values, expected):
    with pytest.raises(trackers.TrackerConfigError, match=expected):
        trackers.tracker_config_from_dict(values)


def test_direct_construction_is_checked_too():
    with pytest.raises(trackers.TrackerConfigError, match="Tracker type 'tensorboard': key 'logdir' must be a string"):
        trackers.TensorboardConfig(logdir=3)


def test_build_puts_relative_paths_under_the_run_dir(tmp_path):
    tracker = trackers.build_tracker(
        trackers.tracker_configs_from_value([{"type": "jsonl"}, {"type": "jsonl", "path": "extra/m.jsonl"}]),
        tmp_path,
    )
    assert isinstance(tracker, trackers.CompositeTracker)
    with tracker:
        tracker.log({"a": 1}, step=0)
    for path in (tmp_path / "metrics.jsonl", tmp_path / "extra" / "m.jsonl"):
        assert json.loads(path.read_text()) == {"step": 0, "a": 1}


def test_build_passes_the_resume_step_to_jsonl(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    trackers.JsonlConfig().build(tmp_path, resume_from_step=2).finish()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_only_process_zero_writes_unless_configured(tmp_path):
    assert isinstance(trackers.JsonlConfig().build(tmp_path, process_index=1), trackers.NoopTracker)
    assert not (tmp_path / "metrics.jsonl").exists()

    everywhere = trackers.JsonlConfig(all_processes=True)
    with everywhere.build(tmp_path, process_index=0) as first, everywhere.build(tmp_path, process_index=1) as other:
        first.log({"a": 0}, step=0)
        other.log({"a": 1}, step=0)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 0, "a": 0}
    assert json.loads((tmp_path / "metrics.process-1.jsonl").read_text()) == {"step": 0, "a": 1}


def test_a_failed_build_finishes_what_was_already_built(tmp_path):
    (tmp_path / "blocked").write_text("a file where the tensorboard directory should go")
    configs = (trackers.JsonlConfig(), trackers.TensorboardConfig(logdir="blocked"))
    with pytest.raises(FileExistsError):
        trackers.build_tracker(configs, tmp_path)
    # the jsonl tracker was closed: its file can be reopened and appended in order
    with trackers.JsonlTracker(tmp_path / "metrics.jsonl") as tracker:
        tracker.log({"a": 1}, step=0)


def test_register_a_custom_tracker_config(tmp_path, monkeypatch):
    # register into a copy of the registry, so the new type does not outlive this test
    import trackers.config_registry

    monkeypatch.setattr(trackers.config_registry, "_registry", dict(trackers.tracker_config_types()))

    @trackers.register_tracker_config("test-jsonl-copy")
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class CopyConfig(trackers.TrackerConfig):
        name: str = "copy.jsonl"
        extra: dict[str, int] | None = None

        def _build(self, run_dir, process_index, resume_from_step):
            return trackers.JsonlTracker(run_dir / self.name)

    config = trackers.tracker_config_from_dict({"type": "test-jsonl-copy", "extra": {"a": 1}})
    assert isinstance(config, CopyConfig)
    with pytest.raises(trackers.TrackerConfigError, match="key 'extra' must be dict or null, got 3"):
        trackers.tracker_config_from_dict({"type": "test-jsonl-copy", "extra": 3})
    with config.build(tmp_path) as tracker:
        tracker.log({"a": 2}, step=5)
    assert json.loads((tmp_path / "copy.jsonl").read_text()) == {"step": 5, "a": 2}
    with pytest.raises(ValueError, match="already registered"):
        trackers.register_tracker_config("jsonl")(CopyConfig)


def test_a_config_class_without_build_cannot_be_instantiated():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Unfinished(trackers.TrackerConfig):
        name: str = "x"

    with pytest.raises(TypeError, match=r"abstract method '?_build'?"):
        Unfinished()
    with pytest.raises(TypeError, match="abstract"):
        trackers.TrackerConfig()
