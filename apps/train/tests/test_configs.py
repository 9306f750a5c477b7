"""Every config shipped in configs/ loads and validates, alone or as an overlay."""

from pathlib import Path

import pytest

from lm_train.config import load_train_config
from lm_train.errors import ConfigError

CONFIGS = Path(__file__).parents[3] / "configs"
FULL = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "gpt2_nano_sophia.yaml")


@pytest.mark.parametrize("path", FULL, ids=[p.stem for p in FULL])
def test_config_loads(path: Path):
    config, _ = load_train_config([path])
    assert config.model.Pos.size == config.model.seq_len
    assert config.trainer.num_train_steps > 0


def test_sophia_overlay_changes_only_the_optimizer():
    base, _ = load_train_config([CONFIGS / "gpt2_nano.yaml"])
    sophia, _ = load_train_config([CONFIGS / "gpt2_nano.yaml", CONFIGS / "gpt2_nano_sophia.yaml"])
    assert type(sophia.optimizer).__name__ == "SophiaGConfig"
    assert sophia.model == base.model and sophia.data == base.data and sophia.trainer == base.trainer


def test_nano_configs_share_the_builtin_corpus():
    for name in ("gpt2_nano", "llama_nano", "mpt_nano", "backpack_nano"):
        config, _ = load_train_config([CONFIGS / f"{name}.yaml"])
        assert config.data.builtin == "python_stdlib"
        assert config.model.model_type == name.split("_")[0]


@pytest.mark.parametrize(("raw", "expected"), [("true", True), ("2", 2), ("1", 1), ("auto", "auto")])
def test_scan_unroll_is_read_from_a_flag(raw, expected):
    config, _ = load_train_config([CONFIGS / "gpt2_nano.yaml"], ["--model.scan_unroll", raw])
    assert config.model.scan_unroll == expected and type(config.model.scan_unroll) is type(expected)


def test_a_bad_scan_unroll_names_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"scan_unroll must be true .* a positive number of layers .* or auto"):
        load_train_config([CONFIGS / "gpt2_nano.yaml"], ["--model.scan_unroll", "0"])


def test_a_tracker_without_a_type_is_wandb_as_in_levanter():
    config, _ = load_train_config([CONFIGS / "gpt2_nano.yaml"], ["--trainer.tracker", "{project: p, tags: [a]}"])
    (wandb,) = config.trainer.tracker
    assert type(wandb).__name__ == "WandbConfig" and (wandb.project, wandb.tags) == ("p", ("a",))
    config, _ = load_train_config([CONFIGS / "gpt2_nano.yaml"], ["--trainer.tracker", "[{project: p}, {type: jsonl}]"])
    assert [type(t).__name__ for t in config.trainer.tracker] == ["WandbConfig", "JsonlConfig"]


_WITHOUT_JAX = """
import importlib.abc, runpy, sys

HEAVY = ("jax", "jaxlib", "equinox", "optax", "torch", "ray", "tensorstore", "transformers")


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HEAVY:
            raise ImportError(f"{name} was imported, but loading a config must not need it")


sys.meta_path.insert(0, Refuse())
from lm_train.config import load_train_config

for path in sys.argv[1:]:
    config, _ = load_train_config([path])
    config.model.flops_per_token(100)
sys.argv = ["lm-train", "run", "--help"]
runpy.run_module("lm_train", run_name="__main__")
"""


def test_configs_decode_and_help_prints_without_jax(tmp_path: Path):
    """A config error comes before anything expensive: decoding and checking every shipped config, and `run --help`,
    import none of jax, equinox, optax, torch, Ray, tensorstore or transformers (the heavy half of a start)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_JAX, *map(str, FULL)], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--trainer.num_train_steps" in done.stdout
