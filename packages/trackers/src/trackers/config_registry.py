"""Tracker configs: plain frozen dataclasses, registered by `type` name, checked, and built into trackers.

This registry is separate from the `type:`-keyed registries of lm-models and lm-train (`lm_models.config_registry`,
decoded by draccus) on purpose: trackers depends on neither lm-models nor draccus, so that any program can use it
to log. Its configs therefore decode from plain mappings here, with their own type checks and error messages;
an app that uses draccus registers a decoder that calls `tracker_configs_from_value` (lm-train does).
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from trackers.composite import CompositeTracker
from trackers.noop import NoopTracker
from trackers.process import current_process_index
from trackers.tracker import Tracker


class TrackerConfigError(ValueError):
    """A tracker config that cannot be used: unknown type, unknown key or a value of the wrong kind."""


class _BadValueError(TrackerConfigError):
    """A value of the wrong kind; `detail` says which key and what it must be, for re-wording with context."""

    def __init__(self, type_name: str, detail: str) -> None:
        super().__init__(f"Tracker type {type_name!r}: {detail}")
        self.detail = detail


_registry: dict[str, type[TrackerConfig]] = {}

ConfigT = TypeVar("ConfigT", bound="type[TrackerConfig]")


def _suggestion(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in typing.get_args(hint))
    if origin is tuple:
        item = typing.get_args(hint)[0]
        return "a list of " + {str: "strings", int: "integers", float: "numbers"}.get(item, str(item))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, "null" if hint is type(None) else getattr(hint, "__name__", str(hint))
    )


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is Literal:
        return any(type(value) is type(arg) and value == arg for arg in typing.get_args(hint))
    if origin is tuple:
        item_hint = typing.get_args(hint)[0]
        return isinstance(value, tuple) and all(_matches(item, item_hint) for item in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    # Other generics (dict[str, int], list[str]...) are checked by their container type only.
    return isinstance(value, origin or hint)


def _literal_strings(hint: Any) -> list[str]:
    if typing.get_origin(hint) is Literal:
        return [arg for arg in typing.get_args(hint) if isinstance(arg, str)]
    return [text for arg in typing.get_args(hint) for text in _literal_strings(arg)]


def _allows_tuple(hint: Any) -> bool:
    if typing.get_origin(hint) is tuple:
        return True
    return any(_allows_tuple(arg) for arg in typing.get_args(hint))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackerConfig(abc.ABC):
    """Base of every tracker config; unless `all_processes`, processes other than 0 get a NoopTracker."""

    type: ClassVar[str] = ""
    all_processes: bool = False

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            hint = hints[field.name]
            if not _matches(value, hint):
                hint_text = _suggestion(value, _literal_strings(hint)) if isinstance(value, str) else ""
                raise _BadValueError(
                    self.type,
                    f"key {field.name!r} must be {_describe(hint)}, got {value!r} ({type(value).__name__})."
                    f"{hint_text} Fix that value in the tracker config.",
                )

    def build(
        self,
        run_dir: str | Path | None = None,
        *,
        process_index: int | None = None,
        resume_from_step: int | None = None,
    ) -> Tracker:
        """The tracker this config describes; relative paths are under `run_dir` (default: the working dir).

        `process_index` defaults to jax.process_index() when jax is imported, else 0.
        `resume_from_step` makes file-based trackers drop what was logged at or after that step.
        """
        index = current_process_index() if process_index is None else process_index
        if index != 0 and not self.all_processes:
            return NoopTracker()
        base = Path(run_dir) if run_dir is not None else Path()
        return self._build(base, index, resume_from_step)

    def check_ready(self) -> None:
        """Raise TrackerConfigError when this tracker could not start here (no credentials, say); starts nothing."""
        return  # most trackers need nothing but a folder, which they make when built

    @abc.abstractmethod
    def _build(self, run_dir: Path, process_index: int, resume_from_step: int | None) -> Tracker:
        """The tracker, on the process that logs (each registered config defines it)."""

    def to_dict(self) -> dict[str, Any]:
        """The config as `tracker_config_from_dict` reads it (with its `type`; tuples as lists)."""
        values = {
            field.name: list(value) if isinstance(value := getattr(self, field.name), tuple) else value
            for field in dataclasses.fields(self)
        }
        return {"type": self.type, **values}


def register_tracker_config(name: str) -> Callable[[ConfigT], ConfigT]:
    """Class decorator: make a TrackerConfig dataclass selectable as `type: <name>`."""

    def register(cls: ConfigT) -> ConfigT:
        if not (isinstance(cls, type) and issubclass(cls, TrackerConfig) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"register_tracker_config({name!r}) decorates TrackerConfig dataclasses, not {cls!r}.")
        if name in _registry and _registry[name] is not cls:
            raise ValueError(
                f"Tracker type {name!r} is already registered by {_registry[name].__qualname__}; pick another name."
            )
        cls.type = name
        _registry[name] = cls
        return cls

    return register


def tracker_config_types() -> dict[str, type[TrackerConfig]]:
    """Every registered tracker config class by its type name."""
    return dict(sorted(_registry.items()))


def tracker_config_from_dict(values: Mapping[str, Any] | TrackerConfig, where: str = "tracker") -> TrackerConfig:
    """The registered config named by `values["type"]`, built from the other keys (lists become tuples).

    `where` names the place in the user's config for error messages (e.g. "trainer.tracker[1]").
    """
    if isinstance(values, TrackerConfig):
        return values
    known = ", ".join(sorted(_registry))
    if not isinstance(values, Mapping):
        raise TrackerConfigError(
            f"{where} must be a mapping with a 'type' key (one of {known}), got {values!r}; "
            "e.g. {type: jsonl} or {type: wandb, project: my-project}."
        )
    if "type" not in values:
        raise TrackerConfigError(
            f"{where} has no 'type' key; add one of {known}, e.g. {{type: wandb, project: my-project}}."
        )
    name = values["type"]
    if name not in _registry:
        raise TrackerConfigError(
            f"{where}: unknown tracker type {name!r}.{_suggestion(str(name), list(_registry))} Valid types: {known}."
        )
    cls = _registry[name]
    hints = typing.get_type_hints(cls)
    valid_keys = [field.name for field in dataclasses.fields(cls)]
    arguments: dict[str, Any] = {}
    for key, value in values.items():
        if key == "type":
            continue
        if key not in valid_keys:
            raise TrackerConfigError(
                f"{where}: unknown key {key!r} for tracker type {name!r}.{_suggestion(str(key), valid_keys)} "
                f"Valid keys: {', '.join(['type', *valid_keys])}."
            )
        if isinstance(value, list) and _allows_tuple(hints[key]):
            value = tuple(value)
        arguments[key] = value
    try:
        return cls(**arguments)
    except _BadValueError as error:
        raise TrackerConfigError(f"{where} (type {name!r}): {error.detail}") from None


def check_trackers_ready(
    configs: Sequence[TrackerConfig], *, process_index: int | None = None, where: str = "tracker"
) -> None:
    """Raise TrackerConfigError, naming `where[i]`, for the first config that would not start on this process.

    For a program to call before its expensive work: a tracker is otherwise built only when the first metric is
    near, and wandb, say, stops there for want of an API key.
    """
    index = current_process_index() if process_index is None else process_index
    for i, config in enumerate(configs):
        if index != 0 and not config.all_processes:
            continue  # built as a NoopTracker on this process
        try:
            config.check_ready()
        except TrackerConfigError as error:
            place = where if len(configs) == 1 else f"{where}[{i}]"
            raise TrackerConfigError(f"{place} (type {config.type!r}): {error}") from None


def tracker_configs_from_value(value: Any, where: str = "tracker") -> tuple[TrackerConfig, ...]:
    """Configs from what YAML gives: one mapping, a list of mappings, or null (no trackers)."""
    if value is None:
        return ()
    if isinstance(value, Mapping | TrackerConfig):
        return (tracker_config_from_dict(value, where),)
    if isinstance(value, list | tuple):
        return tuple(tracker_config_from_dict(item, f"{where}[{i}]") for i, item in enumerate(value))
    raise TrackerConfigError(
        f"{where} must be a tracker mapping or a list of them, got {value!r}; e.g. {{type: jsonl}} or "
        "[{type: wandb, project: p}, {type: tensorboard}]."
    )


def build_tracker(
    configs: TrackerConfig | Sequence[TrackerConfig],
    run_dir: str | Path | None = None,
    *,
    process_index: int | None = None,
    resume_from_step: int | None = None,
) -> Tracker:
    """One tracker for several configs (a CompositeTracker when there are more than one)."""
    if isinstance(configs, TrackerConfig):
        configs = [configs]
    built: list[Tracker] = []
    try:
        for config in configs:
            built.append(config.build(run_dir, process_index=process_index, resume_from_step=resume_from_step))
    except BaseException:
        for tracker in built:
            tracker.finish()
        raise
    if len(built) == 1:
        return built[0]
    if not built:
        return NoopTracker()
    return CompositeTracker(built)
