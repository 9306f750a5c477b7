"""Progress of a build: a rich bar on a terminal, plain lines elsewhere, or a task on the caller's own Progress."""

import io
import os
import re
import select
import subprocess
import sys

from rich.console import Console
from rich.progress import Progress, TextColumn

from shard_cache import build_cache
from shard_cache.inputs import Shard
from shard_cache.ledger import Ledger, ShardState
from shard_cache.progress import BuildProgress, _LineDisplay


def test_plain_lines_are_rate_limited_never_repeated_and_end_with_the_final_state(monkeypatch):
    lines, now = [], [0.0]
    monkeypatch.setattr("shard_cache.progress.time.monotonic", lambda: now[0])
    display = _LineDisplay(lines.append, "build", total=100.0)
    for t, completed, text in (
        (0, 0, "0/2 shards"),
        (1, 10, "0/2 shards"),
        (2, 50, "1/2 shards"),
        (6, 60, "1/2 shards"),
    ):
        now[0] = t
        display.update(completed, text)  # printed at t=0 and t=6 only (one line per 5 s at most)
    now[0] = 6.5
    display.update(60, "1/2 shards")
    display.close(finished=True)  # the last state, at once
    assert lines == ["build: 0% · 0/2 shards", "build: 60% · 1/2 shards · ETA 0:00:04", "build: 100% · 1/2 shards"]
    unknown_size = []
    display = _LineDisplay(unknown_size.append, "build", total=None)
    for t in (20, 30, 40):
        now[0] = t
        display.update(0, "0/1 shards · 5 docs")  # due each time, but the same line: printed once
    display.close(finished=True)
    assert unknown_size == ["build: 0/1 shards · 5 docs"]


def test_an_empty_input_gives_no_byte_total_and_the_bar_ends_complete(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    shards = [Shard(name="empty", files=(str(tmp_path / "empty.jsonl"),))]
    ledger = Ledger(shards=[ShardState(name="empty")])
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    tracker = BuildProgress(shards, ledger, console, None, 0.0)
    assert tracker.bytes_total is None  # not a bar of "0/0 B"
    ledger.shards[0].done = True
    ledger.refresh_order()
    tracker.report()
    tracker.close()
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", buffer.getvalue())
    assert "shard-cache build" in text and "1/1 shards · 0 docs · 0 tokens" in text and "100%" in text


def test_a_build_adds_its_task_to_the_callers_progress_and_leaves_it_running(tmp_path, tokenizer_path, tools):
    for s in range(2):
        tools.write_jsonl(tmp_path / f"in-{s}.jsonl", tools.make_docs(5, seed=20 + s))
    buffer = io.StringIO()
    progress = Progress(TextColumn("{task.description} {task.fields[stats]}"), console=Console(file=buffer))
    progress.start()
    try:
        seen = []
        result = build_cache(
            [str(tmp_path / "in-{0..1}.jsonl")],
            str(tmp_path / "cache"),
            tokenizer=str(tokenizer_path),
            chunk_size=2,
            progress=progress,
            metrics_callback=seen.append,
        )
        assert progress.live.is_started  # the caller's display is the caller's to stop
        (task,) = progress.tasks
        assert task.finished and task.fields["stats"].startswith(f"2/2 shards · {result.docs} docs · {result.tokens:,}")
        assert seen[-1].as_dict()["preprocessing/shards_finished"] == 2.0
    finally:
        progress.stop()


def test_the_command_under_a_pseudo_terminal_draws_one_bar(tmp_path, tokenizer_path, tools, ray_cluster):
    for s in range(2):
        tools.write_jsonl(tmp_path / f"in-{s}.jsonl", tools.make_docs(6, seed=24 + s))
    leader, follower = os.openpty()
    env = {**os.environ, "COLUMNS": "140", "TERM": "xterm"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shard_cache.cli", "build", str(tmp_path / "in-{0..1}.jsonl"), "--tokenizer",
         str(tokenizer_path), "--out", str(tmp_path / "cache"), "--chunk-size", "2", "--ray-address", ray_cluster],
        stdout=follower, stderr=follower, env=env,
    )  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 120)
        if not ready:
            break
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=60) == 0
    raw = b"".join(chunks).decode("utf-8", "replace")
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", raw)
    assert "━" in text and "shard-cache build" in text  # rich's bar, drawn on the terminal
    assert "2/2 shards · 12 docs" in text and "built " in text and "100%" in text
    final = [line for line in text.replace("\r", "\n").splitlines() if "built " in line]
    assert len(final) == 1 and final[0].startswith("built ")  # the result line is not fused with the bar
