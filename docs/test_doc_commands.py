"""Runs every ```bash block of the user guides and the README's quick start, so the commands cannot rot.

Pages: getting-started.md, architecture.md, scaling.md, troubleshooting.md, sft-lora.md, and the quick start of
README.md.

How a page runs:
- It gets a fresh working directory holding a copy of configs/ and `cache/python_stdlib`, a link to the tokenizer
  and cache of the built-in corpus. That cache is built once per session, by `lm-train cache
  configs/gpt2_nano.yaml`, the same build that the first `lm-train run` of a fresh checkout does; sharing it keeps
  this test within a few minutes.
- Its ```bash blocks run in order, in that directory, each as one `bash -euo pipefail` script. `uv run` finds the
  workspace through UV_PROJECT and does not sync (UV_NO_SYNC): the commands use the environment the tests run in.
  XLA_FLAGS is cleared, so a command sees the one CPU device of a laptop unless it sets XLA_FLAGS itself; only the
  session's LLVM level stays (the root conftest's -O0, which halves the CPU time of the commands' compiles).
- The fence's info string may carry these settings, visible in the markdown source:
    ci="ARGS"      appended to every `lm-train run|eval|cache|config show` command of the block: CI trains a few
                   steps where the page trains hundreds;
    exit=N         the block must exit with status N (the block shows an error on purpose);
    expect="TEXT"  TEXT must appear in the block's output (stdout and stderr).
- ```text blocks are never run: commands for GPUs, TPUs, clusters and installs, which this machine cannot run.
- README.md's quick start runs first, in getting-started's directory, as a reader would run it before reading on
  (getting-started's first command then resumes that run). The README is not ours to annotate, so it gets
  README_SETTINGS below: its `lm-train run` gets getting-started's ci arguments, and its `uv run pytest` line is
  skipped: that is the command that runs this test.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DOCS = Path(__file__).parent
ROOT = DOCS.parent
PAGES = [DOCS / n for n in ("getting-started.md", "architecture.md", "scaling.md", "troubleshooting.md", "sft-lora.md")]
README = ROOT / "README.md"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
# Subcommands that take a config and overrides, to which a block's ci="..." arguments are appended.
CONFIG_COMMAND = re.compile(r"\blm-train (run|eval|cache|config show)\b")
# Fence languages a guide may use; only bash runs. Anything else (sh, console, ...) would silently escape the test.
# What ends a command within a line; the ci arguments go before it.
COMMAND_ENDS = (" | ", " && ", " || ", "; ", " # ", " > ", " 2>")
ALLOWED_LANGUAGES = {"bash", "text", "python", "yaml", "json", ""}
README_SETTINGS = {
    "ci": "--trainer.num_train_steps 4 --trainer.steps_per_eval 4 --trainer.max_eval_batches 2",
    "skip": ("uv run pytest",),
}
BLOCK_TIMEOUT_S = 600


@dataclass
class Block:
    """One ```bash block: its commands and the settings of its info string."""

    page: str
    index: int
    script: str
    ci: str = ""
    exit: int = 0
    expect: list[str] = field(default_factory=list)


def fences(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block of a markdown text, in order."""
    return [(info.strip(), body) for info, body in FENCE.findall(text)]


def parse_info(info: str) -> tuple[str, dict[str, list[str]]]:
    """`bash ci="--a 1" exit=2` -> ("bash", {"ci": ["--a 1"], "exit": ["2"]})."""
    words = shlex.split(info)
    language = words[0] if words else ""
    settings: dict[str, list[str]] = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or key not in ("ci", "exit", "expect"):
            raise ValueError(f"unknown fence setting {word!r} in ```{info}")
        settings.setdefault(key, []).append(value)
    return language, settings


def logical_lines(script: str) -> list[str]:
    """Lines with backslash continuations joined."""
    out: list[str] = []
    pending = ""
    for line in script.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


def with_ci_args(line: str, ci: str) -> str:
    """The line with `ci` appended to its lm-train command: before a pipe, `&&`, redirection, comment or `&`."""
    match = CONFIG_COMMAND.search(line) if ci else None
    if match is None:
        return line
    code = line.rstrip()
    ends = [i for sep in COMMAND_ENDS if (i := code.find(sep, match.end())) >= 0]
    if code.endswith("&") and not code.endswith("&&"):
        ends.append(len(code) - 1)
    end = min(ends, default=len(code))
    rest = code[end:].strip()
    return f"{code[:end].rstrip()} {ci}" + (f" {rest}" if rest else "")


def bash_blocks(page: Path, settings: dict | None = None) -> list[Block]:
    """The page's ```bash blocks, with their ci arguments applied (and skipped lines removed, for the README)."""
    blocks: list[Block] = []
    for i, (info, body) in enumerate(fences(page.read_text(encoding="utf-8")), 1):
        language, opts = parse_info(info)
        if language != "bash":
            continue
        ci = " ".join(opts.get("ci", [])) or (settings or {}).get("ci", "")
        skip = (settings or {}).get("skip", ())
        lines = [with_ci_args(line, ci) for line in logical_lines(body) if not line.strip().startswith(tuple(skip))]
        exit_code = int(opts.get("exit", ["0"])[0])
        blocks.append(Block(page.name, i, "\n".join(lines) + "\n", ci, exit_code, opts.get("expect", [])))
    return blocks


def command_env() -> dict[str, str]:
    env = dict(os.environ)
    fast_compile = "--xla_backend_optimization_level=0"
    env.pop("XLA_FLAGS", None)
    if fast_compile in os.environ.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = fast_compile
    env.update(
        {
            "UV_PROJECT": str(ROOT),
            "UV_NO_SYNC": "1",
            "UV_FROZEN": "1",
            "JAX_PLATFORMS": "cpu",
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "NO_COLOR": "1",
        }
    )
    return env


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.script],
        cwd=cwd,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )


@pytest.fixture(scope="session")
def stdlib_cache(tmp_path_factory, stdlib_cache_dir: Path) -> Path:
    """The tokenizer and cache of the built-in corpus, built once for every page (and shared with the other
    tests that train on it, through the root conftest's stdlib_cache_dir)."""
    if shutil.which("uv") is None:
        pytest.fail("uv is not on PATH: the docs' commands are `uv run ...`. Install it with `pip install uv`.")
    work = tmp_path_factory.mktemp("docs-cache")
    shutil.copytree(ROOT / "configs", work / "configs")
    block = Block("fixture", 0, f"uv run lm-train cache configs/gpt2_nano.yaml --data.cache_dir {stdlib_cache_dir}\n")
    done = run_block(block, work)
    assert done.returncode == 0, f"building the stdlib cache failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return stdlib_cache_dir


def page_dir(tmp_path: Path, stdlib_cache: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(ROOT / "configs", work / "configs")
    (work / "cache").mkdir()
    (work / "cache" / "python_stdlib").symlink_to(stdlib_cache, target_is_directory=True)
    return work


def check_blocks(blocks: list[Block], cwd: Path) -> None:
    for block in blocks:
        done = run_block(block, cwd)
        output = done.stdout + done.stderr
        where = f"{block.page}, block {block.index}:\n{block.script}"
        assert done.returncode == block.exit, (
            f"{where}exited with {done.returncode}, expected {block.exit}:\n{done.stdout[-3000:]}\n"
            f"{done.stderr[-5000:]}"
        )
        for text in block.expect:
            assert text in output, f"{where}output lacks {text!r}:\n{output[-5000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_commands_run(page: Path, tmp_path: Path, stdlib_cache: Path) -> None:
    """Every ```bash block of a guide runs, in order, in a fresh working directory."""
    blocks = bash_blocks(page)
    if page.name == "getting-started.md":
        readme = bash_blocks(README, README_SETTINGS)
        assert any("lm-train run" in b.script for b in readme), "the README's quick start lost its `lm-train run`"
        blocks = readme + blocks
    if not blocks:
        pytest.skip(f"{page.name} has no bash block")
    check_blocks(blocks, page_dir(tmp_path, stdlib_cache))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_guides_use_only_known_fences(page: Path) -> None:
    """A command in ```sh or ```console would escape this test; guides use bash (run) or text (not run)."""
    for info, _ in fences(page.read_text(encoding="utf-8")):
        language, _ = parse_info(info)
        assert language in ALLOWED_LANGUAGES, f"{page.name}: fence ```{info} is neither run nor allowed"


def test_ci_args_go_to_config_commands_only() -> None:
    ci = "--trainer.num_train_steps 4"
    assert with_ci_args("uv run lm-train run configs/a.yaml  # train", ci) == (
        "uv run lm-train run configs/a.yaml --trainer.num_train_steps 4 # train"
    )
    assert with_ci_args("X=1 uv run lm-train eval c.yaml &", ci) == "X=1 uv run lm-train eval c.yaml " + ci + " &"
    assert with_ci_args("uv run lm-train config show c.yaml | grep x", ci) == (
        "uv run lm-train config show c.yaml --trainer.num_train_steps 4 | grep x"
    )
    assert with_ci_args("uv run lm-train cache c.yaml && ls", ci) == f"uv run lm-train cache c.yaml {ci} && ls"
    assert with_ci_args("uv run lm-train sample runs/a", ci) == "uv run lm-train sample runs/a"
    assert with_ci_args("ls runs", ci) == "ls runs"


def test_fence_parsing(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        '```bash ci="--a 1" exit=2 expect="bad thing"\nuv run lm-train run \\\n  c.yaml\n```\n'
        "```text\nsrun lm-train run c.yaml\n```\n```bash\nls\n```\n",
        encoding="utf-8",
    )
    first, second = bash_blocks(page)
    assert first.script == "uv run lm-train run    c.yaml --a 1\n"
    assert (first.exit, first.expect, first.index) == (2, ["bad thing"], 1)
    assert second.script == "ls\n" and second.index == 3
    with pytest.raises(ValueError, match="unknown fence setting"):
        parse_info("bash cii=1")
