"""Where a run keeps its compiled programs: the config's key, else the user's JAX setting, else beside the caches."""

from __future__ import annotations

import pytest

from lm_train.config.data_config import DataConfig
from lm_train.config.schema import TrainLmConfig
from lm_train.config.trainer_config import TrainerConfig
from lm_train.errors import ConfigError
from lm_train.run.compile_cache import compilation_cache_dir


def config(cache_dir: str = "cache", **trainer) -> TrainLmConfig:
    return TrainLmConfig(
        data=DataConfig(builtin="python_stdlib", cache_dir=cache_dir), trainer=TrainerConfig(**trainer)
    )


def test_the_cache_sits_beside_the_data_caches_unless_the_user_says_otherwise(monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert compilation_cache_dir(config("/data/caches")) == "/data/caches/jax-compiled"
    assert compilation_cache_dir(config("gs://bucket/caches")) is None  # a bucket: not by default
    assert compilation_cache_dir(config(compilation_cache=False)) is None
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/home/me/.jax")
    assert compilation_cache_dir(config("/data/caches")) == "/home/me/.jax"
    assert compilation_cache_dir(config("gs://b/c", compilation_cache_dir="gs://b/jax")) == "gs://b/jax"
    assert compilation_cache_dir(config(compilation_cache=False, compilation_cache_dir="/x")) is None


def test_the_keys_are_typed(tmp_path):
    from lm_train.config import load_train_config

    path = tmp_path / "c.yaml"
    path.write_text("data: {builtin: python_stdlib}\ntrainer: {compilation_cache_dir: /tmp/jax}\n", encoding="utf-8")
    assert load_train_config([path])[0].trainer.compilation_cache_dir == "/tmp/jax"
    with pytest.raises(ConfigError, match=r"trainer\.compilation_cache"):
        load_train_config([path], ["--trainer.compilation_cache", "sometimes"])
