"""The `trainer.profiler` and `trainer.eval_harness` sections: a jax.profiler trace of some steps; lm-eval tasks."""

from __future__ import annotations

from dataclasses import dataclass

from lm_train.errors import ConfigError


@dataclass(frozen=True)
class ProfilerConfig:
    """A jax.profiler trace of some train steps, written under <run_dir>/profile (Levanter's keys)."""

    enabled: bool | None = None
    """true/false; null: on when start_step or num_steps is given."""
    start_step: int | None = None
    """First traced step (the step about to run, counted from 0); default 5 when on."""
    num_steps: int | None = None
    """Steps traced; default 25 when on."""
    perfetto_link: bool = False
    """After the trace, serve it and print a ui.perfetto.dev link (blocks the run until the link is opened)."""

    @property
    def active(self) -> bool:
        return self.enabled if self.enabled is not None else (self.start_step is not None or self.num_steps is not None)

    @property
    def first_step(self) -> int:
        return 5 if self.start_step is None else self.start_step

    @property
    def steps(self) -> int:
        return 25 if self.num_steps is None else self.num_steps

    def __post_init__(self) -> None:
        if self.start_step is not None and self.start_step < 0:
            raise ConfigError(f"trainer.profiler.start_step must be >= 0, got {self.start_step}.")
        if self.num_steps is not None and self.num_steps < 1:
            raise ConfigError(f"trainer.profiler.num_steps must be at least 1, got {self.num_steps}.")


@dataclass(frozen=True)
class EvalHarnessConfig:
    """lm-evaluation-harness tasks run on the model during training (needs the `harness` extra)."""

    tasks: tuple[str, ...] = ()
    """Task names: the built-in stdlib_next_line_mc, stdlib_line_completion, stdlib_perplexity, or tasks of
    include_path; empty: off."""
    every: int = 1000
    """Run the tasks every this many steps (and at the end)."""
    max_examples: int | None = None
    """Score at most this many examples per task; null: all."""
    include_path: str | None = None
    """A directory of your own lm-eval YAML task configs (with local data_files)."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt; null: each task's own setting (0 for the built-in tasks)."""

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError(f"trainer.eval_harness.every must be at least 1, got {self.every}.")
        if self.max_examples is not None and self.max_examples < 1:
            raise ConfigError(f"trainer.eval_harness.max_examples must be at least 1, got {self.max_examples}.")
