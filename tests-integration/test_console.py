"""What a person sees of `lm-train run` while its cache builds: one console, on a terminal and in a pipe."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess

import trackers

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
STEP_LINE = re.compile(r"step (\d+)\b")  # the tracker's `step 2  ...` and a bar's `step 2/6 ...` alike
PREPROCESSING = {"preprocessing/docs", "preprocessing/tokens", "preprocessing/shards_finished"}


def _config(tiny_project, name: str) -> str:
    """The tiny config with the console tracker, so that both the bar and the tracker print."""
    text = tiny_project.config.read_text(encoding="utf-8")
    text = text.replace("trainer:\n", "trainer:\n  tracker: [{type: console}]\n", 1)
    return str(tiny_project.write_config(name, text))


def _args(config: str, mode: str) -> list[str]:
    # A cache folder of its own: the cache builds while the run trains, as on a first run.
    run = ["run", config, "--trainer.run_dir", f"runs/console-{mode}", "--data.cache_dir", f"cache-console-{mode}"]
    return [*run, "--trainer.num_train_steps", "6"]


def _under_a_terminal(command: list[str], args: list[str], cwd) -> str:
    """Run `lm-train ARGS` with stdout and stderr on a pseudo-terminal; returns everything it wrote."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "160", "LINES": "50", "TERM": "xterm-256color"}
    process = subprocess.Popen([*command, *args], cwd=cwd, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 300)
        if not ready:
            process.kill()
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closes when the process exits
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def _check_step_lines(text: str) -> None:
    """Each logged step printed once, each on a line of its own (not fused onto a bar or another line)."""
    segments = re.split(r"[\r\n]", ANSI.sub("", text))
    training = [s for s in segments if "eval/" not in s]  # the eval line of a step is a line of its own
    steps = [int(m.group(1)) for s in training for m in STEP_LINE.finditer(s)]
    assert sorted(steps) == [2, 4, 6], text[-3000:]
    fused = [s for s in segments if STEP_LINE.search(s) and not s.startswith("step ")]
    assert not fused, fused
    assert not [s for s in segments if "hyperparameters" in s and not s.strip().startswith("hyperparameters")]


def _check_preprocessing_metrics(run_dir) -> None:
    rows = trackers.read_jsonl(run_dir / "metrics.jsonl")
    logged = [r for r in rows if set(r) >= PREPROCESSING]
    assert logged, "no preprocessing metrics while the cache built"
    assert all(r["step"] % 2 == 0 for r in logged)  # at the training log interval
    last = logged[-1]
    assert last["preprocessing/docs"] > 0 and last["preprocessing/tokens"] > 0
    assert "preprocessing/tokens_per_second" in last


def test_console_under_a_terminal(tiny_project, lm_train_command):
    text = _under_a_terminal(
        lm_train_command, _args(_config(tiny_project, "console-tty.yaml"), "tty"), tiny_project.root
    )
    _check_step_lines(text)
    assert "compiling the train step" in ANSI.sub("", text)
    _check_preprocessing_metrics(tiny_project.root / "runs/console-tty")


def test_console_in_a_pipe(tiny_project, cli):
    result = cli(_args(_config(tiny_project, "console-pipe.yaml"), "pipe"), tiny_project.root)
    assert result.returncode == 0, result.stderr[-3000:]
    _check_step_lines(result.stdout + "\n" + result.stderr)
    assert "\x1b[" not in result.stdout + result.stderr  # no terminal codes in a log file
    _check_preprocessing_metrics(tiny_project.root / "runs/console-pipe")
