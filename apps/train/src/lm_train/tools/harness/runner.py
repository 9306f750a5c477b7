"""Running lm-eval tasks on a model: offline task loading, the evaluation, and its scores as tracker metrics."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lm_train.errors import UserError, require_lm_eval
from lm_train.tools.harness.builtin_tasks import BUILTIN_TASKS, write_builtin_tasks
from lm_train.tools.harness.progress import HarnessProgress


def build_lm(model: Any, config: Any, plan: Any, tokenizer: Any, batch_size: int | None = None) -> Any:
    """An lm-eval LM for a trained model on its mesh (its tokenizer's EOS is the prefix and stop token)."""
    require_lm_eval()
    import shard_cache
    from lm_train.tools.harness.adapter import LmTrainLM
    from lm_train.tools.token_scoring import scorer_for

    scorer = scorer_for(model, config, plan, batch_size)
    eos_id = shard_cache.TokenizerProcessor(tokenizer).eos_id
    return LmTrainLM(model, tokenizer, eos_id, scorer, plan, seed=config.trainer.seed)


def task_manager(tasks_dir: Path, include_path: str | None) -> Any:
    """An lm-eval TaskManager over the built-in tasks (written into tasks_dir) and the user's directory."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    paths: list[str | Path] = [str(write_builtin_tasks(tasks_dir))]
    if include_path:
        if not Path(include_path).is_dir():
            raise UserError(
                f"trainer.eval_harness.include_path / --include-path: {include_path} is not a directory of lm-eval "
                "YAML task configs."
            )
        paths.append(str(Path(include_path).resolve()))
    # lm-eval's own catalogue is left out: its tasks download their data, and indexing it takes seconds.
    return TaskManager(include_path=paths, include_defaults=False)


def evaluate_tasks(
    lm: Any,
    tasks: Sequence[str],
    *,
    tasks_dir: Path,
    include_path: str | None = None,
    max_examples: int | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
) -> Mapping[str, Any]:
    """lm-eval's results dict (results per task, and samples when asked) for `tasks`."""
    require_lm_eval()
    import random

    import jax
    import numpy as np
    from lm_eval.evaluator import evaluate

    manager = task_manager(tasks_dir, include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        known = sorted(set(manager.all_tasks))
        raise UserError(
            f"Unknown evaluation task(s) {unknown}. Known here: {', '.join(known)} (built-in: "
            f"{', '.join(BUILTIN_TASKS)}); add your own lm-eval YAML task configs with include_path."
        )
    # lm-eval logs each task's setup at INFO; the run's console keeps to its own lines.
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    # What lm-eval's simple_evaluate does before `evaluate`, without its environment report (which imports
    # torch and runs subprocesses, seconds each time): fixed seeds, and each task's few-shot setting.
    random.seed(0)
    np.random.seed(1234)
    loaded = manager.load(list(tasks))
    for task in loaded["tasks"].values():
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=1234)
    # lm-eval shows only its tokenizing bar: the scoring after it, minutes on a CPU, gets a line of our own.
    with HarnessProgress(list(loaded["tasks"]), enabled=jax.process_index() == 0) as progress:
        lm.progress = progress
        try:
            results = evaluate(lm=lm, task_dict=loaded, limit=max_examples, bootstrap_iters=0, log_samples=log_samples)
        finally:
            lm.progress = None
    if results is None:  # lm-eval returns results on its rank 0 only; ours is always rank 0
        raise RuntimeError("lm-eval returned no results")
    return results


def harness_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """`harness/<task>/<metric>` for every numeric score (filter `none` dropped; stderr entries left out)."""
    metrics = {}
    for task, scores in results.get("results", {}).items():
        for key, value in scores.items():
            name, _, filter_name = key.partition(",")
            if "_stderr" in name or name in ("sample_len", "alias") or not isinstance(value, int | float):
                continue
            if isinstance(value, bool) or not math.isfinite(value):
                continue
            suffix = "" if filter_name in ("", "none") else f"_{filter_name}"
            metrics[f"harness/{task}/{name}{suffix}"] = float(value)
    return metrics
