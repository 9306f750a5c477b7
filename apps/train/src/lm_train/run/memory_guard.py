"""A run that does not fit in memory, found before it costs anything: the plan's estimate before the compile,
XLA's own figure after it, and an out-of-memory at run time, each as one paragraph and exit status 2."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass, field
from typing import Any

from lm_train.config.batch_sizes import planned_batch
from lm_train.errors import UserError
from lm_train.planning.memory_limit import LIMIT_ENV, MemoryLimit
from lm_train.run.preflight import RunSetup

SKIP_ENV = "LM_TRAIN_SKIP_MEMORY_CHECK"
SKIP_FLAG = "--skip-memory-check"
GiB = 2**30
_ALLOCATING = re.compile(r"allocating (\d+) bytes")


class OutOfMemoryError(UserError):
    """A run that does not fit in its devices' memory, found before or while it runs."""


def skip_requested() -> bool:
    """Whether the user turned the checks off (--skip-memory-check sets LM_TRAIN_SKIP_MEMORY_CHECK=1)."""
    return os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _gib(n: int) -> str:
    """Bytes in the unit a person reads them in: GiB, or MiB and KiB below a GiB."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.2f} KiB"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether a jax runtime error is an allocation that failed for want of memory."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def compiled_peak_bytes(compiled: Any) -> int | None:
    """XLA's peak per device for a compiled program: arguments + outputs not aliased to them + temporaries."""
    analysis = compiled.memory_analysis()
    if analysis is None:  # a backend without the analysis
        return None
    return int(
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )


@dataclass
class MemoryGuard:
    """The run's memory limit and the figures found so far, for the checks and for an out-of-memory's message."""

    limit: MemoryLimit | None
    estimate: int | None = None  # the plan's peak per device, traced before the compile
    compiled: int | None = None  # XLA's peak per device, read from the compiled step
    fixes: list[str] = field(default_factory=list)  # the plan's changes that fit, each alone
    skip: bool = False

    def _limit_words(self) -> str:
        assert self.limit is not None
        return f"{_gib(self.limit.per_device)} per device ({self.limit.why})"

    def _advice(self) -> str:
        fixes = (
            "The smallest change that fits: " + "; or ".join(self.fixes) + "."
            if self.fixes
            else "No single change tried (a remat policy, more microbatches, a larger model axis, loss blocks) fits: "
            "use more devices or a smaller model, batch or seq_len."
        )
        return (
            f"{fixes} `lm-train plan` with the same config shows the whole plan. If the figure is wrong for this "
            f"machine, {SKIP_FLAG} (or {SKIP_ENV}=1) runs anyway, and {LIMIT_ENV} sets the limit."
        )

    def check_estimate(self) -> None:
        """Refuse, before the compile, a run whose traced peak exceeds the limit."""
        if self.skip or self.limit is None or self.estimate is None or self.estimate <= self.limit.per_device:
            return
        raise OutOfMemoryError(
            f"this run will not fit in memory: the plan's peak estimate is {_gib(self.estimate)} per device, and the "
            f"limit is {self._limit_words()}; nothing was compiled or run. {self._advice()}"
        )

    def check_compiled(self, compiled: Any) -> None:
        """Refuse, after the compile and before the first step, a run whose compiled peak exceeds the limit."""
        self.compiled = compiled_peak_bytes(compiled)
        if self.skip or self.limit is None or self.compiled is None or self.compiled <= self.limit.per_device:
            return
        estimate = f" (the plan estimated {_gib(self.estimate)})" if self.estimate is not None else ""
        raise OutOfMemoryError(
            f"this run will not fit in memory: XLA's compiled train step needs {_gib(self.compiled)} per device at "
            f"its peak{estimate}, and the limit is {self._limit_words()}; no step was run. {self._advice()}"
        )

    def out_of_memory(self, error: BaseException) -> OutOfMemoryError | None:
        """The paragraph for an allocation that failed while the run ran; None for any other error."""
        if not is_out_of_memory(error):
            return None
        found = _ALLOCATING.search(str(error))
        what = f"an allocation of {_gib(int(found.group(1)))}" if found else "an allocation"
        figures = []
        if self.estimate is not None:
            figures.append(f"the plan estimated a peak of {_gib(self.estimate)} per device")
        if self.compiled is not None:
            figures.append(f"XLA's compiled step needs {_gib(self.compiled)}")
        if self.limit is not None:
            figures.append(f"the limit is {self._limit_words()}")
        known = f" ({'; '.join(figures)})" if figures else ""
        return OutOfMemoryError(
            f"the run ran out of memory: {what} failed{known}. The checkpoints already saved are intact, and "
            f"a rerun resumes from the newest. {self._advice()}"
        )


class _PolicyEstimates(dict):
    """Each remat policy's estimate, traced when first read (a refusal reads only those it needs)."""

    def __init__(self, estimate: Any):
        super().__init__()
        self._estimate = estimate

    def __missing__(self, policy: str) -> Any:
        self[policy] = self._estimate(policy)
        return self[policy]


def with_run_loss_blocks(setup: RunSetup) -> RunSetup:
    """The setup with the loss in vocabulary blocks where, on these CPU devices, one microbatch's logits would not
    fit in a device's share of the host's RAM (planning.loss_blocks)."""
    from lm_train.planning.devices import present_devices
    from lm_train.planning.loss_blocks import with_loss_blocks
    from lm_train.planning.memory_limit import limit_override
    from lm_train.planning.setup import plan_vocabulary

    spec = present_devices()
    if spec.platform != "cpu":
        return setup
    try:
        vocab, _ = plan_vocabulary(setup.config, None)
    except UserError:
        return setup  # a tokenizer not here yet: data preparation says so
    trainer = planned_batch(setup.config, setup.plan.data_size, setup.dist.process_count).trainer
    rows = trainer.train_batch_size // setup.plan.data_size // setup.step_settings.microbatches
    config = with_loss_blocks(setup.config, vocab, rows, "cpu", limit_override() or spec.memory_bytes)
    return setup if config is setup.config else dataclasses.replace(setup, config=config)


def check_before_compile(setup: RunSetup, kind: Any) -> MemoryGuard:
    """The run's memory guard, its estimate traced (not compiled); refuses a run whose estimate exceeds the limit."""
    import jax

    from lm_train.config.loading import dump_config
    from lm_train.planning.devices import present_devices
    from lm_train.planning.estimate import Planner
    from lm_train.planning.estimate_cache import cached_estimate, estimate_key
    from lm_train.planning.memory_limit import device_memory_limit
    from lm_train.planning.setup import plan_vocabulary
    from lm_train.planning.suggest import changes_that_fit
    from lm_train.planning.trace import with_remat

    guard = MemoryGuard(device_memory_limit(jax.devices()), skip=skip_requested())
    planned = kind  # the planner traces the step of any kind in the table (lm_train.kinds)
    if guard.skip or guard.limit is None:
        return guard
    try:
        vocab, _ = plan_vocabulary(setup.config, None)
    except UserError:
        return guard  # a tokenizer not here yet: data preparation says so; XLA's figure is still checked
    config, limit = planned_batch(setup.config, setup.plan.data_size, setup.dist.process_count), guard.limit.per_device
    spec = present_devices()
    planner = functools.cache(lambda: Planner(config, spec, vocab, planned))  # unneeded when the estimate is kept
    # Where its files go does not change the step: a new run id of the same config reuses the estimate.
    trainer = dataclasses.replace(config.trainer, id=None, run_dir=None)
    key = estimate_key(dump_config(dataclasses.replace(config, trainer=trainer)), vocab, spec.text, planned.name)
    guard.estimate = cached_estimate(key, lambda: planner().estimate(config).peak_bytes)
    if guard.estimate > limit:
        policies = _PolicyEstimates(lambda policy: planner().estimate(with_remat(config, policy)))
        guard.fixes = changes_that_fit(planner(), planner().estimate(config), policies, limit, first=True)
        guard.check_estimate()
    return guard
