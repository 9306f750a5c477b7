"""Levanter keys with no field of their own here: renamed onto ours, accepted with a note, or refused by feature.

Runs on the merged raw config before the schema check, so that a Levanter config resolves unchanged wherever
the key has a meaning here, and says why where it has none.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from lm_train.config.yaml_files import KeyPath, Sources
from lm_train.errors import ConfigError

# Levanter key -> our key with the same meaning (the value is moved as it is).
RENAMED: dict[KeyPath, KeyPath] = {
    ("trainer", "jax_compilation_cache_dir"): ("trainer", "compilation_cache_dir"),
    ("optimizer", "warmup_ratio"): ("optimizer", "warmup"),  # Levanter 1.1's older name of `warmup`
}

# Levanter keys that only tune Levanter's own machinery; accepted, and named in a one-line note.
INTERNAL: dict[KeyPath, str] = {
    ("data", "cache_options"): "sizes Levanter's cache writer; shard-cache picks its own chunking",
    ("data", "rows_per_chunk"): "sizes Levanter's cache chunks; shard-cache picks its own (data.chunk_size)",
    ("data", "stream"): "asks Levanter to stream a hub dataset; lm-train reads local or bucket files",
    ("data", "plaintext"): "Levanter 1.1's plain-text switch; lm-train reads each file by its extension",
    ("data", "splits"): "names hub dataset splits; lm-train reads train_urls and validation_urls",
    ("data", "name"): "names a hub dataset's configuration; lm-train downloads no dataset",
    ("data", "permutation_type"): "picks Levanter's shuffle permutation; lm-train's order is its era shuffle",
    ("trainer", "log_dir"): "Levanter's log directory; lm-train logs into the run directory",
    ("trainer", "run_base_dir"): "Levanter's run root; lm-train uses trainer.run_dir",
    ("trainer", "jax_config"): "sets Levanter's jax flags; lm-train sets the ones it needs",
    ("trainer", "distributed"): "Levanter's jax.distributed settings; lm-train takes --coordinator-address etc.",
    ("trainer", "require_accelerator"): "Levanter's accelerator check",
    ("trainer", "shutdown_at_exit"): "Levanter's TPU shutdown switch",
    ("trainer", "log_jaxprs"): "Levanter's jaxpr dump",
    ("trainer", "log_xla_hlo"): "Levanter's HLO dump",
    ("trainer", "crash_on_nan"): "Levanter's NaN check; lm-train's loss scale or skip rules apply",
    ("trainer", "crash_on_inf"): "Levanter's Inf check",
    ("trainer", "profiler_perfetto_link"): "Levanter's Perfetto link",
}

# Levanter features not built here: (the value that means "off", the feature's name). Off is accepted quietly.
MISSING_FEATURES: dict[KeyPath, tuple[Any, str]] = {
    ("hf_save_dtype",): (None, "exporting in another dtype (the export keeps the parameters' dtype)"),
    ("initialize_from_checkpoint_path",): (None, "starting a new run from another run's checkpoint"),
    ("eval_harness",): (None, "a top-level eval_harness section: give it as `trainer.eval_harness`"),
    ("eval_harness_steps",): (10000, "a top-level eval_harness_steps: give it as `trainer.eval_harness`"),
    ("log_entropy",): (False, "logging the entropy of the predictions"),
    ("trainer", "initialize_from"): (None, "starting from another run's trainer checkpoint"),
    ("trainer", "allow_partial_checkpoint"): (False, "loading a checkpoint that lacks part of the state"),
    ("trainer", "replica_ici_axis_size"): (1, "replica mesh axes (multi-slice data parallelism)"),
    ("trainer", "replica_dcn_axis_size"): (1, "replica mesh axes (multi-slice data parallelism)"),
    ("trainer", "profiler_start_step"): (5, "a Levanter profiler window: give it as `trainer.profiler`"),
    ("trainer", "profiler_num_steps"): (100, "a Levanter profiler window: give it as `trainer.profiler`"),
    ("data", "ignore_token_id"): (None, "an ignored token id in the loss (masks come from data.format here)"),
    ("data", "target_budget"): (None, "mixture token budgets"),
    ("data", "experiment_budget"): (None, "mixture token budgets"),
    ("data", "max_train_batches"): (None, "a per-source cap on training batches"),
    ("data", "num_validation_sequences"): (None, "validation sequences carved out of training sources"),
    ("optimizer", "cooldown"): (None, "a separate cooldown phase of the learning-rate schedule"),
    ("optimizer", "haps"): (None, "cyclic learning-rate schedules (haps)"),
    ("optimizer", "nesterov"): (False, "Nesterov momentum in Adam"),
    ("optimizer", "update_rms_clipping"): (None, "clipping the update's RMS"),
    ("optimizer", "clip_update_norm"): (False, "clipping the update's norm"),
    ("optimizer", "adamc_weight_decay"): (False, "AdamC's weight decay correction"),
    ("optimizer", "default_weight_decay_mask"): (
        None,
        "Levanter's default weight-decay mask (set optimizer.weight_decay_modules)",
    ),
}


def _get(raw: dict, path: KeyPath) -> tuple[dict | None, str]:
    node: Any = raw
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) and path[-1] in node else None), path[-1]


def _optimizer_defines(raw: dict, path: KeyPath) -> bool:
    """Whether `path` is a key of the selected optimizer.type's own config (Muon's `nesterov`), not a lack."""
    import dataclasses

    from lm_train.config import kron_config, optimizer_recipes  # noqa: F401  (register the newer optimizers)

    section = raw.get("optimizer")
    if len(path) != 2 or path[0] != "optimizer" or not isinstance(section, dict):
        return False
    try:
        config_class = optimizer_recipes.OptimizerConfig.get_choice_class(section.get("type", "adam"))
    except KeyError:  # an unknown type: the decoder names it with the known ones
        return False
    assert dataclasses.is_dataclass(config_class)  # every registered optimizer config is one
    return path[1] in {f.name for f in dataclasses.fields(config_class)}


def _model_defaults(model: Any, notes: list[str]) -> None:
    """A model section as Levanter 1.1 wrote it: no `type` is GPT-2 (its default, and ours), and a Llama with no
    num_kv_heads has one per head (1.1 had no grouped-query attention) where our default of 32 cannot divide."""
    if not isinstance(model, dict):
        return
    if "type" not in model:
        model["type"] = "gpt2"
        notes.append("note: `model` has no `type`; it is gpt2, Levanter 1.1's default and lm-train's.")
    heads = model.get("num_heads")
    if model["type"] == "llama" and "num_kv_heads" not in model and isinstance(heads, int) and heads % 32:
        model["num_kv_heads"] = heads


def translate_levanter_keys(raw: dict[str, Any], sources: Sources, note: Any = None) -> list[str]:
    """Rewrite raw (in place) so Levanter's own keys resolve; returns the notes said (to stderr unless `note`)."""
    say = note or (lambda text: print(text, file=sys.stderr))
    notes: list[str] = []
    trainer = raw.get("trainer")
    if isinstance(trainer, dict) and "wandb" in trainer:
        wandb = trainer.pop("wandb")
        if "tracker" in trainer:
            raise ConfigError(
                f"{sources.where(('trainer', 'wandb'))}: `trainer.wandb` (Levanter's) and `trainer.tracker` are both "
                "given; keep one (`trainer.tracker: {type: wandb, ...}`)."
            )
        trainer["tracker"] = {"type": "wandb", **(wandb or {})}
        sources.locations.setdefault(("trainer", "tracker"), sources.where(("trainer", "wandb")))
    _model_defaults(raw.get("model"), notes)
    for old, new in RENAMED.items():
        node, key = _get(raw, old)
        if node is not None:
            target, _ = _get(raw, new)
            if target is not None:
                raise ConfigError(f"{sources.where(old)}: `{'.'.join(old)}` and `{'.'.join(new)}` are both given.")
            node[new[-1]] = node.pop(key)
    for path, why in INTERNAL.items():
        node, key = _get(raw, path)
        if node is not None:
            node.pop(key)
            notes.append(f"note: `{'.'.join(path)}` is accepted and ignored: {why}.")
    for path, (off, feature) in MISSING_FEATURES.items():
        node, key = _get(raw, path)
        if node is None or _optimizer_defines(raw, path):
            continue
        value = node.pop(key)
        if value != off and value is not None:
            raise ConfigError(
                f"{sources.where(path)}: `{'.'.join(path)}: {value!r}` asks for {feature}, a Levanter feature that "
                f"lm-train does not have yet. Remove the key (or set it to {off!r}) to train without it."
            )
    for text in notes:
        say(text)
    return notes


def levanter_paths() -> Sequence[KeyPath]:
    """Every Levanter key handled here, for the docs test."""
    return [("trainer", "wandb"), *RENAMED, *INTERNAL, *MISSING_FEATURES]
