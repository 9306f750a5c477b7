"""`trainer.watch`: norms and histograms of gradients, parameters, updates or optimizer state, from the step.

They are computed inside the compiled step and leave it through `trackers.jit_log`, only on the steps the
interval selects (a `lax.cond`): the other steps compute nothing for them and make no host round trip.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

import trackers
from lm_train.config.trainer_config import WatchConfig
from lm_train.run.step import WatchFn

HISTOGRAM_BINS = 32


def _floating(tree: Any) -> Any:
    return eqx.filter(tree, eqx.is_inexact_array)


def watch_metrics(config: WatchConfig, targets: dict[str, Any]) -> dict[str, Any]:
    """The metrics of the watched targets (jit-compatible)."""
    metrics: dict[str, Any] = {}
    for name in config.watch_targets:
        summary = trackers.summarize_tree(
            _floating(targets[name]),
            name,
            bins=HISTOGRAM_BINS if config.include_histograms else None,
            per_leaf=config.include_per_parameter_norms or config.include_histograms,
            include_max=False,
            split_axis="layers" if config.split_scan_layers else None,
        )
        if not config.include_per_parameter_norms:
            summary = {k: v for k, v in summary.items() if "/norm/" not in k or k.endswith("/norm/total")}
        if not config.include_norms:
            summary = {k: v for k, v in summary.items() if "/norm/" not in k}
        metrics.update(summary)
    return metrics


def make_watch(config: WatchConfig) -> WatchFn | None:
    """The step's watch function for a config, or None when watching is off (the step then has none)."""
    if not config.enabled:
        return None

    def watch(*, step: jax.Array, grads: Any, params: Any, updates: Any, opt_state: Any) -> None:
        targets = {"grads": grads, "params": params, "updates": updates, "opt_state": opt_state}

        def log(_: None) -> None:
            trackers.jit_log(watch_metrics(config, targets), step=step)

        jax.lax.cond(step % config.interval == 0, log, lambda _: None, None)

    return watch
