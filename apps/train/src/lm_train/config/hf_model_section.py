"""The model section of a run that starts from a local Hugging Face directory: what the YAML and the flags leave out
comes from its config.json, so that only a key the user wrote can disagree with the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_train.config.yaml_files import Sources, deep_merge
from lm_train.errors import ConfigError


def _local_hf_config(raw: dict[str, Any]) -> Path | None:
    """The config.json of `initialize_from_hf` when it names a local directory that has one."""
    source = raw.get("initialize_from_hf")
    if not isinstance(source, str) or not source or "://" in source:
        return None  # unset, Levanter's `true`, or a URL: preflight checks those, and reads a URL's config itself
    config_file = Path(source).expanduser() / "config.json"
    return config_file if config_file.is_file() else None


@dataclass(frozen=True)
class FilledModel:
    """What a model section was completed from: the checkpoint's model config, its file, and the keys written."""

    checkpoint: Any
    config_file: Path
    written: tuple[str, ...]


def fill_model_from_hf(raw: dict[str, Any], sources: Sources) -> FilledModel | None:
    """Complete the raw `model` section from initialize_from_hf's config.json (its type included) where the config
    leaves keys out, in place; None when there is no local config.json to read."""
    config_file = _local_hf_config(raw)
    written = raw.get("model")
    if config_file is None or not isinstance(written, dict | None):
        return None
    import draccus

    import hf_bridge

    try:
        checkpoint = hf_bridge.read_model_config(str(config_file.parent))
    except hf_bridge.HfBridgeError as e:
        raise ConfigError(f"{sources.where(('initialize_from_hf',))}: initialize_from_hf: {e}") from None
    written = written or {}
    if "type" in written and written["type"] != checkpoint.model_type:
        kind = checkpoint.model_type
        raise ConfigError(
            f"{sources.where(('model', 'type'))}: model.type is {written['type']!r}, but {config_file} "
            f"(initialize_from_hf) describes a {kind} model. Set model.type to {kind!r}, or leave it out: a key "
            "the config does not write comes from config.json."
        )
    raw["model"] = deep_merge({"type": checkpoint.model_type, **draccus.encode(checkpoint)}, written)
    return FilledModel(checkpoint, config_file, tuple(written))


def check_written_model_keys(filled: FilledModel, model: Any, sources: Sources) -> None:
    """Refuse, naming the key's file and line, a model key the user wrote that changes what the weights mean."""
    import hf_bridge

    try:
        hf_bridge.check_compatible(filled.checkpoint, model, str(filled.config_file), other="the model section")
    except hf_bridge.HfBridgeError as e:
        field = next((k for k in filled.written if f"gives {k}=" in str(e)), None)  # the key hf_bridge names
        where = sources.where(("model", field) if field else ("model",))
        raise ConfigError(
            f"{where}: {e} Keys the config leaves out come from config.json: remove the key to take the "
            "checkpoint's value."
        ) from None
