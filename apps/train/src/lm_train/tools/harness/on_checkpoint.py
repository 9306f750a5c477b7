"""`lm-train harness CHECKPOINT`: lm-eval tasks on a saved model; scores printed and written as JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lm_train.errors import UserError
from lm_train.tools.output_files import check_output_file, make_output_folder


def harness_checkpoint(
    checkpoint: str | Path,
    tasks: Sequence[str],
    *,
    max_examples: int | None = None,
    include_path: str | None = None,
    num_fewshot: int | None = None,
    batch_size: int | None = None,
    out: Path | None = None,
    log_samples: bool = False,
) -> tuple[dict[str, float], Path, Mapping[str, Any]]:
    """The `harness/<task>/<metric>` scores of a checkpoint, the JSON file they were written to, and lm-eval's
    results."""
    from lm_train.errors import require_lm_eval
    from lm_train.tools.harness.runner import build_lm, evaluate_tasks, harness_metrics

    if not tasks:
        raise UserError("Name at least one task: --tasks stdlib_next_line_mc (repeat the flag for more).")
    if max_examples is not None and max_examples < 1:
        raise UserError(f"--max-examples must be at least 1, got {max_examples}.")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}; leave it out for the eval batch.")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot must be 0 or more, got {num_fewshot}; leave it out for each task's own.")
    if out is not None:
        check_output_file(out, "--out")
    require_lm_eval()  # before the model is loaded
    from lm_train.run.checkpoints import load_model
    from lm_train.run.mesh import plan_mesh

    loaded = load_model(checkpoint)
    lm = build_lm(loaded.model, loaded.config, plan_mesh(loaded.config.trainer), loaded.tokenizer, batch_size)
    results = evaluate_tasks(
        lm,
        tasks,
        tasks_dir=loaded.paths.run_dir / "harness" / "tasks",
        include_path=include_path,
        max_examples=max_examples,
        num_fewshot=num_fewshot,
        log_samples=log_samples,
    )
    metrics = harness_metrics(results)
    out = out or loaded.paths.run_dir / "harness" / f"step-{loaded.step}.json"
    make_output_folder(out, "--out")
    record = {"checkpoint": str(loaded.checkpoint), "step": loaded.step, "metrics": metrics}
    if log_samples:
        record["samples"] = results.get("samples", {})
    out.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    return metrics, out, results
