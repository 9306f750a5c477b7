"""What a person sees of `lm-train run` while its cache builds: one console, on a terminal and in a pipe."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios

import pytest
from rich.cells import cell_len

import trackers

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
STEP_LINE = re.compile(r"step (\d+)\b")  # the tracker's `step 2  ...` and a bar's `step 2/6 ...` alike
PREPROCESSING = {"preprocessing/docs", "preprocessing/tokens", "preprocessing/shards_finished"}
SCIENTIFIC = re.compile(r"\d[eE][+-]?\d")  # 3.0e-03, 2.345e+00: the old dump of every metric
COMPACT = re.compile(r"^step (\d+)/6  loss \d+\.\d{4}\b")


def _config(tiny_project, name: str) -> str:
    """The tiny config with the console tracker, so that both the bar and the tracker print."""
    text = tiny_project.config.read_text(encoding="utf-8")
    text = text.replace("trainer:\n", "trainer:\n  tracker: [{type: console}]\n", 1)
    return str(tiny_project.write_config(name, text))


def _args(config: str, mode: str) -> list[str]:
    # A cache folder of its own: the cache builds while the run trains, as on a first run.
    run = ["run", config, "--trainer.run_dir", f"runs/console-{mode}", "--data.cache_dir", f"cache-console-{mode}"]
    return [*run, "--trainer.num_train_steps", "6"]


def _under_a_terminal(command: list[str], args: list[str], cwd, columns: int = 160) -> str:
    """Run `lm-train ARGS` with stdout and stderr on a pseudo-terminal `columns` wide; returns all it wrote."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm-256color"}
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


def _screen_lines(text: str) -> list[str]:
    """What the terminal shows, line by line: control codes removed, each carriage return a redrawn line."""
    return [s for s in re.split(r"[\r\n]", ANSI.sub("", text)) if s.strip()]


def _check_compact_lines(lines: list[str], *, every_figure: bool) -> None:
    """One compact line per logged step (2, 4, 6), no metric in scientific notation, no dump of metric keys."""
    compact = [line for line in lines if COMPACT.match(line)]
    assert [int(COMPACT.match(line).group(1)) for line in compact] == [2, 4, 6], lines[-40:]
    for line in compact:
        assert "ETA " in line, line
        if every_figure:
            assert re.search(r"  lr 0\.\d+  grad norm \d+\.?\d*  [\d,.]+k? tok/s  MFU \d+\.\d%  ETA ", line), line
    assert not [line for line in lines if SCIENTIFIC.search(line) and "step " in line]
    assert not [line for line in lines if "train/loss" in line or "optim/" in line or "throughput/" in line]


def _check_summary(lines: list[str], mode: str) -> None:
    """The short summary in place of the config table: model with params, tokens per step, mesh, config path."""
    assert not [line for line in lines if "hyperparameters" in line or "┃" in line or "│" in line]
    assert any(re.match(r"model +gpt2 \(2 layers, hidden 32, 2 heads\), [\d.]+k params$", line) for line in lines)
    assert any(re.match(r"tokens +256 per step \(8 sequences of 32\)$", line) for line in lines)
    assert any(re.match(r"mesh +8 cpu devices: ", line) for line in lines)
    assert any(re.match(rf"config +runs/console-{mode}/config\.yaml ", line) for line in lines)


@pytest.mark.parametrize("columns", [80, 200])
def test_every_line_fits_the_terminal(tiny_project, lm_train_command, columns):
    """Under a terminal: each step's line once, fitting the width, with every figure where it fits; the summary;
    the live line to its end; the compile announced; the build's counts logged while it ran."""
    mode = f"width-{columns}"
    config = _config(tiny_project, f"console-{mode}.yaml")
    text = _under_a_terminal(lm_train_command, _args(config, mode), tiny_project.root, columns=columns)
    lines = _screen_lines(text)
    too_wide = [line for line in lines if cell_len(line) > columns]
    assert not too_wide, too_wide
    _check_compact_lines(lines, every_figure=columns >= 120)
    _check_summary(lines, mode)
    assert any(line.startswith("train") and "6/6" in line for line in lines)  # the live line, to its end
    _check_step_lines(text)
    assert "compiling the train step" in ANSI.sub("", text)
    _check_preprocessing_metrics(tiny_project.root / f"runs/console-{mode}")


def test_plain_lines_with_every_figure_in_a_pipe(tiny_project, cli):
    """In a pipe: no terminal codes, each step's line once with every figure, the summary, the build's counts."""
    result = cli(_args(_config(tiny_project, "console-plain.yaml"), "plain"), tiny_project.root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\x1b" not in result.stdout + result.stderr and "\r" not in result.stdout + result.stderr
    _check_step_lines(result.stdout + "\n" + result.stderr)
    lines = (result.stdout + "\n" + result.stderr).splitlines()
    _check_compact_lines(lines, every_figure=True)
    _check_summary(lines, "plain")
    _check_preprocessing_metrics(tiny_project.root / "runs/console-plain")
