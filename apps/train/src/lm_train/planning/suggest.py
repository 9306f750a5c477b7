"""The smallest change of each kind that makes a run that does not fit, fit."""

from __future__ import annotations

import dataclasses

from lm_train.errors import ConfigError
from lm_train.planning.estimate import REMAT_ORDER, Planner, policy_name
from lm_train.planning.figures import Estimate, Plan


def _fits_note(planner: Planner, plan: Plan, estimate: Estimate) -> str:
    spare = plan.usable_bytes_per_device - estimate.peak_bytes
    slower = estimate.executed_flops / max(plan.estimate.executed_flops, 1.0) - 1.0
    cost = f", about {slower:+.0%} step time (more recomputation)" if abs(slower) >= 0.005 else ""
    return f"peak {estimate.peak_bytes / 2**30:.2f} GiB, {spare / 2**30:.2f} GiB to spare{cost}"


def suggestions(planner: Planner, plan: Plan, max_tries: int = 6) -> list[str]:
    """The smallest change of each kind that makes the run fit: a remat policy, microbatches, a larger model axis."""
    config, usable, found = planner.config, plan.usable_bytes_per_device, []
    own = policy_name(config.model.gradient_checkpointing)
    start = REMAT_ORDER.index(own) if own in REMAT_ORDER else 0
    for policy in REMAT_ORDER[start + 1 :]:
        estimate = plan.policies[policy]
        if estimate.peak_bytes <= usable:
            found.append(f"--model.gradient_checkpointing {policy}: {_fits_note(planner, plan, estimate)}")
            break
    trainer = config.trainer
    per_device = plan.estimate.local_batch // plan.estimate.microbatches
    tries = 0
    while per_device > 1 and tries < max_tries:
        per_device //= 2
        tries += 1
        candidate = dataclasses.replace(config, trainer=dataclasses.replace(trainer, per_device_parallelism=per_device))
        try:
            estimate = planner.estimate(candidate)
        except ConfigError:
            continue
        if estimate.peak_bytes <= usable:
            found.append(
                f"--trainer.per_device_parallelism {per_device} ({estimate.microbatches} microbatches of gradient "
                f"accumulation): {_fits_note(planner, plan, estimate)}"
            )
            break
    model_axis = plan.estimate.model_axis_size
    tries = 0
    while model_axis * 2 <= planner.spec.count and tries < max_tries:
        model_axis *= 2
        tries += 1
        candidate = dataclasses.replace(
            config, trainer=dataclasses.replace(trainer, model_axis_size=model_axis, mesh=None)
        )
        try:
            estimate = planner.estimate(candidate)
        except ConfigError:
            continue
        if estimate.peak_bytes <= usable:
            found.append(
                f"--trainer.model_axis_size {model_axis} (tensor parallelism over {model_axis} devices): "
                f"{_fits_note(planner, plan, estimate)}"
            )
            break
    if plan.estimate.attention_scores_bytes and not getattr(config.model, "use_flash_attention", True):
        candidate = dataclasses.replace(config, model=dataclasses.replace(config.model, use_flash_attention=True))
        estimate = planner.estimate(candidate)
        if estimate.peak_bytes <= usable:
            found.append(f"--model.use_flash_attention true: {_fits_note(planner, plan, estimate)}")
    return found
