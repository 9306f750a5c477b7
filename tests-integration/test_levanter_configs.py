"""Levanter 1.1's own config files (its wheel's `config/` folder, fetched from PyPI) resolve and train here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from lm_train.config import load_train_config
from lm_train.config.yaml_files import read_merged
from lm_train.errors import ConfigError


def _pip() -> list[str]:
    """pip: the venv's own if it has one (uv's venvs do not), else the one on PATH."""
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    return [sys.executable, "-m", "pip"] if has_pip else [shutil.which("pip") or shutil.which("pip3") or "pip"]


@pytest.fixture(scope="session")
def levanter_configs(tmp_path_factory) -> Path:
    """Levanter 1.1's config folder, from its wheel, downloaded once per session."""
    root = tmp_path_factory.mktemp("levanter")
    done = subprocess.run(
        [*_pip(), "download", "levanter==1.1", "--no-deps", "-d", str(root), "-q"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    wheels = list(root.glob("levanter-1.1-*.whl"))
    if done.returncode != 0 or not wheels:
        reason = f"cannot download levanter==1.1 from PyPI: {done.stderr.strip()[-300:]}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(root / "wheel", [n for n in wheel.namelist() if n.startswith("levanter/config/")])
    return root / "wheel" / "levanter" / "config"


def test_every_levanter_1_1_config_resolves(levanter_configs, cli, tmp_path):
    files = sorted(levanter_configs.glob("*.yaml"))
    assert len(files) == 21
    resolved, refused = [], {}
    for path in files:
        try:
            config, _ = load_train_config([path])
        except ConfigError as e:
            refused[path.name] = str(e)
            continue
        resolved.append(path.name)
        raw, _ = read_merged([path])  # the tracker named by the legacy `trainer.wandb` section is wandb's
        if "wandb" in (raw.get("trainer") or {}):
            (tracker,) = config.trainer.tracker
            assert tracker.to_dict()["type"] == "wandb"
            assert tracker.to_dict()["project"] == raw["trainer"]["wandb"]["project"]
    assert not refused, refused
    assert len(resolved) == 21

    by_name = {p.name: p for p in files}
    # The one config that names no text, only a cache built before (and its tokenizer): it trains on that cache.
    config, _ = load_train_config([by_name["gpt2_1536_legal.yaml"]])
    assert config.data.prebuilt and config.data.cache_dir.endswith("MultiLegalPile_Wikipedia_Shuffled")
    config, _ = load_train_config([by_name["gpt2_7b.yaml"]])
    assert config.fcm_prob == 0.15
    config, _ = load_train_config([by_name["mpt_7b_continued_biomedlm.yaml"]])
    assert config.use_hf_model_config and config.initialize_from_hf.startswith("mosaicml/mpt-7b")

    shown = cli(["config", "show", str(by_name["gpt2_small.yaml"])], cwd=tmp_path)  # one real CLI call, with !include
    assert shown.returncode == 0, shown.stderr
    resolved_yaml = yaml.safe_load(shown.stdout)
    assert resolved_yaml["trainer"]["tracker"][0]["project"] == "levanter"
    assert resolved_yaml["data"]["train_urls"][0].startswith("gs://pubmed-mosaic/openwebtext-sharded/")


def test_levanter_nano_config_trains_on_local_data(levanter_configs, tiny_project, cli):
    """gpt2_nano.yaml unchanged but for its data (and a short, small run)."""
    run = cli(
        [
            "run",
            str(levanter_configs / "gpt2_nano.yaml"),
            "--data.id",
            "null",
            "--data.train_urls",
            "[data/train_{0..1}.jsonl]",
            "--data.validation_urls",
            "[data/valid.jsonl]",
            "--data.tokenizer",
            "tokenizer.json",
            "--data.cache_dir",  # its own: the tiny project's cache has other chunk settings (its chunk_size 8)
            "cache-levanter",
            "--model.seq_len",
            "32",
            "--trainer.num_train_steps",
            "2",
            "--trainer.run_dir",
            "runs/levanter-nano",
        ],
        cwd=tiny_project.root,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = (tiny_project.root / "runs/levanter-nano/metrics.jsonl").read_text().splitlines()
    assert any('"step": 2' in line and "train/loss" in line for line in metrics)
