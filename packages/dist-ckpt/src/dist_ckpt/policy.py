"""When to save: temporary checkpoints on a timer, permanent ones on steps (pure; the clock is injected)."""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


@dataclass(frozen=True)
class KeepPolicy:
    """Keep a permanent checkpoint every `every` steps, up to and including step `until` (None: forever)."""

    every: int
    until: int | None = None

    def covers(self, step: int) -> bool:
        """True when this policy makes `step` a permanent checkpoint."""
        return step % self.every == 0 and (self.until is None or step <= self.until)


def parse_keep(keep: Iterable[KeepPolicy | Mapping[str, Any]]) -> list[KeepPolicy]:
    """KeepPolicy objects from `keep` entries such as {"every": 1000, "until": 10000}."""
    policies = []
    for position, item in enumerate(keep):
        if isinstance(item, KeepPolicy):
            policy = item
        else:
            if not isinstance(item, Mapping) or "every" not in item or set(item) - {"every", "until"}:
                raise ValueError(
                    f"keep[{position}] = {item!r} is not a keep policy: write {{'every': N}} or "
                    "{'every': N, 'until': M} (N: steps between permanent checkpoints, M: the last step it "
                    "covers)."
                )
            policy = KeepPolicy(every=item["every"], until=item.get("until"))
        if not isinstance(policy.every, int) or isinstance(policy.every, bool) or policy.every < 1:
            raise ValueError(f"keep[{position}]: 'every' must be a positive integer, got {policy.every!r}.")
        if policy.until is not None and (not isinstance(policy.until, int) or isinstance(policy.until, bool)):
            raise ValueError(f"keep[{position}]: 'until' must be an integer step or None, got {policy.until!r}.")
        policies.append(policy)
    return policies


@dataclass(frozen=True)
class Decision:
    """Whether to save at a step, and whether that checkpoint is temporary."""

    save: bool
    temporary: bool = False


class SavePolicy:
    """Decides at each step: permanent on keep steps, temporary when `save_interval` passed since a save."""

    def __init__(
        self,
        *,
        save_interval: timedelta | None,
        keep: Iterable[KeepPolicy | Mapping[str, Any]],
        clock: Callable[[], float],
        last_saved_step: int | None = None,
    ):
        if save_interval is not None and save_interval <= timedelta(0):
            raise ValueError(f"save_interval must be positive (or None for no timer), got {save_interval}.")
        self.save_interval = save_interval
        self.keep = parse_keep(keep)
        self.clock = clock
        self.last_saved_step = last_saved_step
        self.last_save_time = clock()

    def decide(self, step: int, *, force: bool = False, force_temporary: bool = False) -> Decision:
        """The decision for `step`; a step already saved is never saved again.

        `force` saves a permanent checkpoint (the end of a run). `force_temporary` saves one now that is temporary
        unless the keep policy covers the step (a job told to stop): the next complete checkpoint supersedes it.
        """
        if step == self.last_saved_step:
            return Decision(save=False)
        now = self.clock()
        if force or any(policy.covers(step) for policy in self.keep):
            decision = Decision(save=True, temporary=False)
        elif force_temporary or self._timer_expired(now):
            decision = Decision(save=True, temporary=True)
        else:
            return Decision(save=False)
        self.record_save(step, now)
        return decision

    def _timer_expired(self, now: float) -> bool:
        if self.save_interval is None:
            return False
        return now - self.last_save_time >= self.save_interval.total_seconds()

    def record_save(self, step: int, now: float | None = None) -> None:
        """Note a save at `step` (restarts the timer)."""
        self.last_saved_step = step
        self.last_save_time = self.clock() if now is None else now
