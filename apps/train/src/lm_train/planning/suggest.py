"""The smallest change of each kind that makes a run that does not fit, fit."""

from __future__ import annotations

import dataclasses

from lm_models import ACCELERATOR_BLOCK_SIZE
from lm_train.config.schema import TrainLmConfig
from lm_train.errors import ConfigError
from lm_train.planning.estimate import REMAT_ORDER, Planner, policy_name
from lm_train.planning.figures import Estimate, Plan


def _fits_note(usable: int, base: Estimate, estimate: Estimate) -> str:
    spare = usable - estimate.peak_bytes
    slower = estimate.executed_flops / max(base.executed_flops, 1.0) - 1.0
    cost = f", about {slower:+.0%} step time (more recomputation)" if abs(slower) >= 0.005 else ""
    return f"peak {estimate.peak_bytes / 2**30:.2f} GiB, {spare / 2**30:.2f} GiB to spare{cost}"


def _estimate_within(
    planner: Planner, candidate: TrainLmConfig, target: int, refused: tuple[type[Exception], ...] = ()
) -> Estimate | None:
    """The estimate of `candidate` if it is within `target` bytes per device, else None (also when it is `refused`)."""
    try:
        estimate = planner.estimate(candidate)
    except refused:
        return None  # a change this config cannot take is no suggestion
    return estimate if estimate.peak_bytes <= target else None


def suggestions(planner: Planner, plan: Plan, max_tries: int = 6, target: int | None = None) -> list[str]:
    """The smallest change of each kind that makes the run fit: a remat policy, microbatches, a larger model axis,
    loss blocks. `target`: the estimate per device to fit within (default: the plan's usable memory)."""
    return changes_that_fit(planner, plan.estimate, plan.policies, plan.usable_bytes_per_device, max_tries, target)


def changes_that_fit(
    planner: Planner,
    base: Estimate,
    policies: dict[str, Estimate],
    usable: int,
    max_tries: int = 6,
    target: int | None = None,
    first: bool = False,
) -> list[str]:
    """The smallest change of each kind whose estimate (of `base`'s run, with `policies` its remat variants, read
    only as far as needed) is within `target` bytes per device (default `usable`, the figure each note's spare
    memory is reported against). `first`: stop at the first change found (each kind costs traces)."""
    config, found = planner.config, []
    target = usable if target is None else target
    note = lambda estimate: _fits_note(usable, base, estimate)  # noqa: E731
    own = policy_name(config.model.gradient_checkpointing)
    start = REMAT_ORDER.index(own) if own in REMAT_ORDER else 0
    for policy in REMAT_ORDER[start + 1 :]:
        estimate = policies[policy]
        if estimate.peak_bytes <= target:
            found.append(f"--model.gradient_checkpointing {policy}: {note(estimate)}")
            break
    if first and found:
        return found
    trainer = config.trainer
    per_device = base.local_batch // base.microbatches
    tries = 0
    while per_device > 1 and tries < max_tries:
        per_device //= 2
        tries += 1
        candidate = dataclasses.replace(config, trainer=dataclasses.replace(trainer, per_device_parallelism=per_device))
        estimate = _estimate_within(planner, candidate, target, (ConfigError,))
        if estimate is not None:
            found.append(
                f"--trainer.per_device_parallelism {per_device} ({estimate.microbatches} microbatches of gradient "
                f"accumulation): {note(estimate)}"
            )
            break
    if first and found:
        return found
    model_axis = base.model_axis_size
    tries = 0
    while model_axis * 2 <= planner.spec.count and tries < max_tries:
        model_axis *= 2
        tries += 1
        candidate = dataclasses.replace(
            config, trainer=dataclasses.replace(trainer, model_axis_size=model_axis, mesh=None)
        )
        estimate = _estimate_within(planner, candidate, target, (ConfigError,))
        if estimate is not None:
            found.append(
                f"--trainer.model_axis_size {model_axis} (tensor parallelism over {model_axis} devices): "
                f"{note(estimate)}"
            )
            break
    if first and found:
        return found
    if base.attention_scores_bytes and not getattr(config.model, "use_flash_attention", True):
        candidate = dataclasses.replace(config, model=dataclasses.replace(config.model, use_flash_attention=True))
        estimate = _estimate_within(planner, candidate, target)
        if estimate is not None:
            found.append(f"--model.use_flash_attention true: {note(estimate)}")
    if first and found:
        return found
    if base.logits_bytes and getattr(config.model, "cross_entropy_block_size", 0) is None:
        # The loss over vocabulary blocks: the full logits never exist at once (not for soft-capped logits).
        block = dataclasses.replace(config.model, cross_entropy_block_size=ACCELERATOR_BLOCK_SIZE)
        estimate = _estimate_within(planner, dataclasses.replace(config, model=block), target, (ValueError,))
        if estimate is not None:
            found.append(f"--model.cross_entropy_block_size {ACCELERATOR_BLOCK_SIZE}: {note(estimate)}")
    return found
