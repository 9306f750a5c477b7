"""A tiny GPT-2 run config shared by the app's unit tests (no data, no Ray: each test makes what it needs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lm_train.config import TrainLmConfig, load_train_config

CONFIG = Path(__file__).parents[3] / "configs" / "gpt2_nano.yaml"
TINY = ["--model.hidden_dim", "32", "--model.num_layers", "2", "--model.num_heads", "2", "--model.seq_len", "16"]
TINY += ["--trainer.train_batch_size", "8", "--trainer.num_train_steps", "4", "--optimizer.warmup", "0"]
VOCAB = 64  # the tests build no tokenizer: any vocabulary size will do


def tiny_config(*overrides: str) -> TrainLmConfig:
    """gpt2_nano shrunk to 32 wide, 2 layers, 16 positions, batch 8, with extra dotted overrides."""
    config, _ = load_train_config([CONFIG], [*TINY, *overrides])
    return config


@pytest.fixture
def make_config():
    return tiny_config
