"""Test-session settings shared by every package: 8 CPU devices, strict jax promotion, quiet Ray."""

import os

import pytest

# Must be set before jax initialises its backends: sharding tests need 8 devices.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ray under `uv run` would otherwise copy the whole workspace (.venv included) into each session.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """Make silent broadcasting and implicit dtype promotion errors in every in-process test."""
    try:
        import jax
    except ImportError:  # packages without jax (shard-cache, trackers) still test alone
        return
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(scope="session")
def stdlib_cache_dir(tmp_path_factory):
    """One cache directory for the built-in corpus, shared by every test that trains on it, so that the tokenizer
    is trained and the cache built once per test session (pass it as --data.cache_dir)."""
    return tmp_path_factory.mktemp("stdlib-cache")
