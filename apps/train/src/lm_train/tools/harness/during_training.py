"""`trainer.eval_harness`: lm-eval tasks on the model being trained, every N steps, scores to the trackers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trackers
from lm_train.config.watching_config import EvalHarnessConfig


class HarnessDuringTraining:
    """Runs the configured tasks on the live model (on the run's mesh) and logs `harness/<task>/<metric>`."""

    def __init__(self, config: EvalHarnessConfig, setup: Any, tracker: trackers.Tracker):
        self.config = config
        self.every = config.every
        self.setup = setup
        self.tracker = tracker
        self._tokenizer = None

    def run(self, model: Any, step: int, note: Callable[[str], None]) -> dict[str, float]:
        """Evaluate the tasks at `step`; every process takes part, process 0 logs."""
        import shard_cache
        from lm_train.tools.harness.runner import build_lm, evaluate_tasks, harness_metrics

        if self._tokenizer is None:
            self._tokenizer = shard_cache.load_tokenizer(str(self.setup.paths.tokenizer_file))
        lm = build_lm(model, self.setup.config, self.setup.plan, self._tokenizer)
        results = evaluate_tasks(
            lm,
            self.config.tasks,
            tasks_dir=self.setup.paths.run_dir / "harness" / "tasks",
            include_path=self.config.include_path,
            max_examples=self.config.max_examples,
            num_fewshot=self.config.num_fewshot,
        )
        metrics = harness_metrics(results)
        if self.setup.is_main:
            self.tracker.log(metrics, step=step)
            note(
                f"harness at step {step}: "
                + "  ".join(f"{k.removeprefix('harness/')} {v:.4f}" for k, v in metrics.items())
            )
        return metrics


def harness_during_training(setup: Any, tracker: trackers.Tracker) -> HarnessDuringTraining | None:
    """The run's harness, or None when trainer.eval_harness names no task; a missing lm-eval fails now."""
    config = setup.config.trainer.eval_harness
    if not config.enabled:
        return None
    from lm_train.errors import require_lm_eval

    require_lm_eval()
    return HarnessDuringTraining(config, setup, tracker)
