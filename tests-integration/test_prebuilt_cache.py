"""A config that names no source of text trains on a cache built before (Levanter's `cache_dir`-only configs).

It reads the session's finished cache of the built-in corpus as it is: the same batches, hence the same losses
bit for bit, as the run that names the corpus, and the cache is not touched. A cache built with other settings,
or a folder without a finished cache, is refused before training, naming the folder and the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_checks import tree_digest

import trackers
from lm_train.config import load_train_config
from lm_train.data.caches import prepare_data
from lm_train.errors import ConfigError, DataError

pytestmark = pytest.mark.slow

TRAINER = """\
trainer:
  seed: 3
  num_train_steps: 4
  train_batch_size: 8
  log_every: 1
  steps_per_eval: 4
  max_eval_batches: 2
optimizer:
  learning_rate: 3.0e-3
  warmup: 1
"""


def _losses(run: Path) -> list[tuple]:
    rows = trackers.read_jsonl(run / "metrics.jsonl")
    return [(r["step"], r.get("train/loss"), r.get("eval/loss")) for r in rows if "train/loss" in r or "eval/loss" in r]


def _prebuilt_yaml(tmp_path: Path, model: str, tokenizer: Path, cache_dir: Path, extra: str = "") -> Path:
    data = f"data:\n  tokenizer: {tokenizer}\n  cache_dir: {cache_dir}\n  shuffle: 2048\n{extra}"
    path = tmp_path / "prebuilt.yaml"
    path.write_text(data + model + TRAINER, encoding="utf-8")
    return path


def test_a_prebuilt_cache_trains_as_the_run_that_built_it_and_is_left_as_it_was(
    tmp_path, cli, stdlib_cache_dir, tiny_model_yaml
):
    (built,) = [p for p in stdlib_cache_dir.iterdir() if p.name.startswith("tok-")]
    tokenizer = stdlib_cache_dir / "tokenizer-bpe4096.json"
    before = tree_digest(built / "train") | tree_digest(built / "validation")

    named = tmp_path / "named.yaml"
    data = f"data:\n  builtin: python_stdlib\n  cache_dir: {stdlib_cache_dir}\n  shuffle: 2048\n  chunk_size: 64\n"
    named.write_text(data + tiny_model_yaml + TRAINER, encoding="utf-8")
    prebuilt = _prebuilt_yaml(tmp_path, tiny_model_yaml, tokenizer, built)
    for config, run in ((named, "named"), (prebuilt, "prebuilt")):
        result = cli(["run", str(config), "--trainer.run_dir", f"runs/{run}"], tmp_path)
        assert result.returncode == 0, result.output[-5000:]

    expected = _losses(tmp_path / "runs" / "named")
    assert [s for s, _, e in expected if e is not None] == [4]  # the validation cache is read too
    assert _losses(tmp_path / "runs" / "prebuilt") == expected
    assert tree_digest(built / "train") | tree_digest(built / "validation") == before


def test_a_prebuilt_cache_is_checked_before_training(tmp_path, stdlib_cache_dir, tiny_model_yaml):
    (built,) = [p for p in stdlib_cache_dir.iterdir() if p.name.startswith("tok-")]
    tokenizer = stdlib_cache_dir / "tokenizer-bpe4096.json"

    config, _ = load_train_config([_prebuilt_yaml(tmp_path, tiny_model_yaml, tokenizer, tmp_path / "nothing-here")])
    with pytest.raises(DataError, match=r"nothing-here/train holds no finished cache.*data.cache_dir"):
        prepare_data(config.data)

    other_eos = _prebuilt_yaml(tmp_path, tiny_model_yaml, tokenizer, built, "  enforce_eos: false\n")
    config, _ = load_train_config([other_eos])
    with pytest.raises(DataError, match=r"tok-.*/train was tokenized with other settings.*enforce_eos"):
        prepare_data(config.data)

    no_tokenizer = tmp_path / "no-tokenizer.yaml"
    no_tokenizer.write_text(f"data:\n  cache_dir: {built}\n" + tiny_model_yaml, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"To train on a cache built before, give no source, and `data\.tokenizer`"):
        load_train_config([no_tokenizer])
