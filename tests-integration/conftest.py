"""Fixtures for tests that run the real `lm-train` command in subprocesses on a tiny corpus of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

LM_TRAIN = [sys.executable, "-m", "lm_train"]


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_cli(args: list[str], cwd: Path, timeout: float = 600, env: dict[str, str] | None = None) -> CliResult:
    """Run `lm-train ARGS` in a fresh interpreter; the result carries both output streams."""
    full_env = dict(os.environ)
    full_env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    full_env.update(env or {})
    done = subprocess.run([*LM_TRAIN, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    return CliResult(done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="session")
def cli():
    """The function that runs `lm-train ARGS` in a subprocess."""
    return run_cli


@pytest.fixture(scope="session")
def lm_train_command() -> list[str]:
    """The argv prefix that starts `lm-train` with this interpreter."""
    return list(LM_TRAIN)


TINY_MODEL = """\
model:
  type: gpt2
  seq_len: 32
  hidden_dim: 32
  num_heads: 2
  num_layers: 2
  gradient_checkpointing: false
"""


@dataclass
class TinyProject:
    """A working directory with a small jsonl corpus, a trained tokenizer and a config that uses them."""

    root: Path
    config: Path

    def write_config(self, name: str, text: str) -> Path:
        path = self.root / name
        path.write_text(text, encoding="utf-8")
        return path


@pytest.fixture(scope="session")
def tiny_project(tmp_path_factory) -> TinyProject:
    """Documents are real Python sources from the standard library (so the loss can fall), as jsonl."""
    from shard_cache import train_tokenizer

    root = tmp_path_factory.mktemp("project")
    data = root / "data"
    data.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in (stdlib / "json").glob("*.py")) + sorted((stdlib / "email").glob("*.py"))
    texts = [p.read_text(encoding="utf-8") for p in sources if p.stat().st_size > 200][:40]
    for shard in range(2):
        with open(data / f"train_{shard}.jsonl", "w", encoding="utf-8") as f:
            for text in texts[shard::2]:
                f.write(json.dumps({"text": text}) + "\n")
    with open(data / "valid.jsonl", "w", encoding="utf-8") as f:
        for text in texts[:6]:
            f.write(json.dumps({"text": text[::-1]}) + "\n")
    train_tokenizer(texts, 384, save_path=root / "tokenizer.json")
    config = root / "tiny.yaml"
    config.write_text(
        f"""\
data:
  train_urls: ["data/train_{{0..1}}.jsonl"]
  validation_urls: ["data/valid.jsonl"]
  tokenizer: tokenizer.json
  cache_dir: cache
  chunk_size: 8
  shuffle: 64
{TINY_MODEL}trainer:
  seed: 1
  num_train_steps: 12
  train_batch_size: 8
  steps_per_eval: 6
  max_eval_batches: 2
  log_every: 2
  checkpointer:
    save_interval: 1h
    keep:
      - every: 2
optimizer:
  learning_rate: 3.0e-3
  warmup: 2
""",
        encoding="utf-8",
    )
    return TinyProject(root, config)
