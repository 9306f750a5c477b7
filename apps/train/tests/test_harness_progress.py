"""The harness's progress line: requests scored of those lm-eval sent, and tasks done, while lm-eval scores."""

from __future__ import annotations

import functools
import itertools
import re
import sysconfig
from pathlib import Path

import pytest

import named_tensors as nt
import shard_cache
from lm_train.run.mesh import plan_mesh
from lm_train.run.state import init_model
from lm_train.tools.harness import runner
from lm_train.tools.harness.progress import HarnessProgress

pytest.importorskip("lm_eval")
TASKS = ["stdlib_next_line_mc", "stdlib_line_completion", "stdlib_perplexity"]
LINE = re.compile(r"^harness  ([\d,]+)/([\d,]+) requests  (\d+)/3 tasks(?:  (\w+))?$")


@pytest.fixture
def tiny_lm(tmp_path, make_config):
    """lm-eval's LM over an untrained 2-layer GPT-2 with a small tokenizer of standard-library sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8") for p in sorted((stdlib / "json").glob("*.py"))]
    path = tmp_path / "tokenizer.json"
    shard_cache.train_tokenizer(texts, 300, save_path=path)
    tokenizer = shard_cache.load_tokenizer(str(path))
    config = make_config("--model.seq_len", "64")
    plan = plan_mesh(config.trainer)
    model = init_model(config, plan, nt.Axis("vocab", tokenizer.get_vocab_size(with_added_tokens=True)))
    return runner.build_lm(model, config, plan, tokenizer, batch_size=8)


def test_every_batch_and_every_task_is_shown_and_the_counts_are_lm_evals(tiny_lm, tmp_path, capsys, monkeypatch):
    # A line for every scored batch (not every 10 s), so that the test sees the counts between the tasks too.
    monkeypatch.setattr(runner, "HarnessProgress", functools.partial(HarnessProgress, every_s=0.0))
    results = runner.evaluate_tasks(tiny_lm, TASKS, tasks_dir=tmp_path / "tasks", max_examples=6, log_samples=True)
    # The reference: the requests lm-eval itself recorded for each sample (one per choice, window or prompt).
    per_task = {task: sum(len(s["arguments"]) for s in samples) for task, samples in results["samples"].items()}
    total = sum(per_task.values())
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("harness  ")]
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    scored = [int(m.group(1).replace(",", "")) for m in parsed]
    sent = [int(m.group(2).replace(",", "")) for m in parsed]
    tasks_done = [int(m.group(3)) for m in parsed]
    assert scored == sorted(scored) and tasks_done == sorted(tasks_done)  # only forward
    assert (scored[-1], sent[-1], tasks_done[-1]) == (total, total, 3)
    assert {m.group(4) for m in parsed} == {"loglikelihood", "loglikelihood_rolling", "generate_until"}
    # Between the first and the last line the count moves a batch (8 requests) at a time, at most.
    assert len(set(scored)) > len(TASKS) + 1 and max(b - a for a, b in itertools.pairwise(scored)) <= 8
    # A task is counted done when the requests scored cover all of its own.
    first_done = tasks_done.index(1)
    assert scored[first_done] >= min(per_task.values())
    assert not tiny_lm.progress  # left unset for the next evaluation


def test_the_live_line_counts_the_same_under_a_run(monkeypatch):
    """Inside a run (its console current), the progress is a task on the run's display, removed at the end."""
    from lm_train.run.console import RunConsole

    with RunConsole(enabled=True) as shown:
        with HarnessProgress(["a", "b"]) as progress:
            (task,) = [t for t in shown.progress.tasks if t.description == "harness"]
            progress.requests("loglikelihood", [_Instance("a"), _Instance("a"), _Instance("b")])
            progress.scored(range(2))
            assert (task.completed, task.total) == (2, 3)
            assert [text for text, _ in task.fields["parts"]][:2] == ["2/3 requests", "1/2 tasks"]
        assert [t for t in shown.progress.tasks if t.description == "harness"] == []


class _Instance:
    def __init__(self, task_name: str):
        self.task_name = task_name
