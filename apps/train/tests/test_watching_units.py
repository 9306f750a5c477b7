"""The pieces of `watching a run` that need no trained model: built-in harness tasks, scores' names, config
checks, the profiler off, viz windows, and the errors that name a missing extra."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lm_train.config.watching_config import ProfilerConfig
from lm_train.errors import ConfigError
from lm_train.run.distributed import DistributedInfo
from lm_train.run.preflight import prepare_run
from lm_train.run.profiling import StepProfiler
from lm_train.tools.harness.builtin_tasks import BUILTIN_TASKS, write_builtin_tasks
from lm_train.tools.harness.runner import harness_metrics
from lm_train.tools.logprob_viz import windows


def test_builtin_tasks_are_deterministic_local_lm_eval_configs(tmp_path):
    import yaml

    a, b = write_builtin_tasks(tmp_path / "a"), write_builtin_tasks(tmp_path / "b")
    for name in BUILTIN_TASKS:
        assert (a / f"{name}.jsonl").read_bytes() == (b / f"{name}.jsonl").read_bytes()
        config = yaml.safe_load((a / f"{name}.yaml").read_text())
        assert config["task"] == name and config["dataset_path"] == "json"
        assert config["dataset_kwargs"]["data_files"]["test"] == str(a / f"{name}.jsonl")  # local, absolute
    rows = [json.loads(line) for line in (a / "stdlib_next_line_mc.jsonl").read_text().splitlines()]
    assert len(rows) >= 20
    for row in rows:
        assert len(row["choices"]) == 4 and len(set(row["choices"])) == 4 and 0 <= row["gold"] < 4
        path, line = row["source"].rsplit(":", 1)
        from lm_train.data.corpus import stdlib_root

        lines = (stdlib_root() / path).read_text(encoding="utf-8").splitlines()
        assert row["choices"][row["gold"]] == lines[int(line) - 1] + "\n"  # the true next line
        assert row["context"] == "\n".join(lines[int(line) - 4 : int(line) - 1]) + "\n"
    completions = [json.loads(line) for line in (a / "stdlib_line_completion.jsonl").read_text().splitlines()]
    assert all(c["target"] and "\n" not in c["target"] for c in completions)
    before = (a / "stdlib_perplexity.yaml").stat().st_mtime_ns
    write_builtin_tasks(tmp_path / "a")  # unchanged content is not rewritten
    assert (a / "stdlib_perplexity.yaml").stat().st_mtime_ns == before


def test_harness_scores_are_named_by_task_and_metric():
    results = {
        "results": {
            "t1": {"alias": "t1", "acc,none": 0.5, "acc_stderr,none": "N/A", "sample_len": 6},
            "t2": {"exact_match,strict": 1.0, "word_perplexity,none": 12.5, "bad,none": float("nan")},
        }
    }
    assert harness_metrics(results) == {
        "harness/t1/acc": 0.5,
        "harness/t2/exact_match_strict": 1.0,
        "harness/t2/word_perplexity": 12.5,
    }


def test_profiler_keys_and_off_by_default(make_config, tmp_path):
    assert not ProfilerConfig().active and ProfilerConfig(start_step=3).active and ProfilerConfig(num_steps=2).active
    assert not ProfilerConfig(start_step=3, enabled=False).active
    on = ProfilerConfig(enabled=True)
    assert (on.first_step, on.steps) == (5, 25)  # Levanter's defaults
    with pytest.raises(ConfigError, match="num_steps must be at least 1"):
        make_config("--trainer.profiler.num_steps", "0")
    with pytest.raises(ConfigError, match="start_step must be >= 0"):
        make_config("--trainer.profiler.start_step", "-1")
    config = make_config()
    assert StepProfiler.for_run(config.trainer.profiler, tmp_path, (0, 1), None, print) is None  # the loop skips it
    profiler = StepProfiler.for_run(ProfilerConfig(start_step=2, num_steps=3), tmp_path, (1, 2), None, print)
    assert (profiler.first, profiler.stop, profiler.trace_dir) == (2, 5, tmp_path / "profile" / "process-1")


def test_eval_harness_config_is_checked_before_any_data(make_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dist = DistributedInfo(process_index=0, process_count=1, mode="single")
    with pytest.raises(ConfigError, match=r"unknown task\(s\) \['hellaswag'\]"):
        prepare_run(make_config("--trainer.eval_harness.tasks", "[stdlib_perplexity, hellaswag]"), dist)
    with pytest.raises(ConfigError, match="every must be at least 1"):
        make_config("--trainer.eval_harness.tasks", "[stdlib_perplexity]", "--trainer.eval_harness.every", "0")
    setup = prepare_run(make_config("--trainer.eval_harness.tasks", "[stdlib_perplexity]"), dist)
    assert setup.config.trainer.eval_harness.tasks == ("stdlib_perplexity",)


def test_viz_windows_predict_every_token_once():
    assert windows(5, 8) == [(0, 5)]
    assert windows(20, 8) == [(0, 8), (7, 15), (14, 20)]
    predicted = [t for start, end in windows(100, 16) for t in range(start + 1, end)]
    assert predicted == list(range(1, 100))


@pytest.mark.parametrize(
    ("module", "extra", "args"),
    [("lm_eval", "harness", ["harness", "no-such-checkpoint", "--tasks", "stdlib_perplexity"])],
)
def test_a_missing_extra_is_one_paragraph_naming_it(tmp_path, module, extra, args):
    script = (
        f"import sys; sys.modules[{module!r}] = None\n"  # as if it were not installed
        f"sys.argv = ['lm-train', *{args!r}]\n"
        "from lm_train.cli import main; main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"pip install 'lm-train[{extra}]'" in done.stderr and "Traceback" not in done.stderr


def test_viz_bad_inputs_are_clear_errors(tmp_path):
    from lm_train.errors import CheckpointError, UserError
    from lm_train.tools.logprob_viz import visualize

    with pytest.raises(UserError, match=r"--out .*page.txt: write an .html file"):
        visualize(tmp_path, tmp_path / "page.txt")
    with pytest.raises(UserError, match="--max-docs and --max-tokens must be at least 1"):
        visualize(tmp_path, tmp_path / "page.html", max_docs=0)
    with pytest.raises(CheckpointError, match="No complete checkpoint at"):
        visualize(tmp_path / "nowhere", tmp_path / "page.html")
    assert not (tmp_path / "page.html").exists()


def test_viz_data_that_names_no_file_is_a_clear_error(tmp_path):
    from lm_train.errors import DataError
    from lm_train.tools.logprob_viz import read_documents

    pattern = str(tmp_path / "missing_*.jsonl")
    with pytest.raises(DataError) as refused:
        read_documents([pattern], "text", max_docs=3)
    assert str(refused.value) == f"--data: input {pattern!r}: the glob matches no file. Check the pattern."


def test_mixture_preprocessing_metrics_are_per_source_and_summed(tmp_path):
    from lm_train.data.build_metrics import MixtureBuildMetrics
    from lm_train.data.caches import PreparedData
    from lm_train.run.loop import _waiting_text, preprocessing_metrics
    from shard_cache import BuildMetrics

    watched = MixtureBuildMetrics(["code", "web"])
    data = PreparedData("tokenizer.json", builds=[], build_metrics=watched, sources={})
    assert preprocessing_metrics(data) == {} and _waiting_text(data) == "waiting for data ..."
    # code: 1 of 4 shards, resumed with 100 tokens from an earlier run; web: nothing committed yet.
    code = BuildMetrics(docs=10, tokens=300, chunks=2, shards_done=1, shards_total=4, skipped=0, elapsed_s=2.0,
                        tokens_at_start=100, bytes_done=250, bytes_total=1000, nodes=2)  # fmt: skip
    watched.sources["code"](code)
    assert preprocessing_metrics(data) == {
        "preprocessing/code/docs": 10.0,
        "preprocessing/code/tokens": 300.0,
        "preprocessing/code/shards_finished": 1.0,
        "preprocessing/code/tokens_per_second": 100.0,  # (300 - 100) / 2 s
        "preprocessing/code/nodes": 2.0,  # per source only: sources share the nodes, so no total is summed
        "preprocessing/docs": 10.0,
        "preprocessing/tokens": 300.0,
        "preprocessing/shards_finished": 1.0,
        "preprocessing/tokens_per_second": 100.0,
    }
    assert preprocessing_metrics(data) == {}  # nothing committed since: no line
    assert _waiting_text(data) == "waiting for data (cache at 25%) ..."
    web = BuildMetrics(docs=5, tokens=700, chunks=1, shards_done=2, shards_total=2, skipped=1, elapsed_s=4.0,
                       bytes_done=3000, bytes_total=3000)  # fmt: skip
    watched.sources["web"](web)
    values = preprocessing_metrics(data)
    assert not any(k.startswith("preprocessing/code/") for k in values)  # code's counts have not moved
    assert values["preprocessing/web/tokens"] == 700.0 and values["preprocessing/web/tokens_per_second"] == 175.0
    assert values["preprocessing/docs"] == 15.0 and values["preprocessing/tokens"] == 1000.0
    assert values["preprocessing/shards_finished"] == 3.0
    assert values["preprocessing/tokens_per_second"] == (200 + 700) / 4.0  # this run's tokens over the longest time
    assert _waiting_text(data) == f"waiting for data (cache at {100 * 3250 / 4000:.0f}%) ..."
