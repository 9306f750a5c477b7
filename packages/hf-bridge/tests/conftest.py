"""Fixtures for the hf-bridge tests: torch + transformers (imported once), token ids and logit helpers."""

import os
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt

TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def hf():
    """torch and transformers, for parity tests; skipped locally without them, a failure in CI."""
    try:
        import torch
        import transformers
    except ImportError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(
                f"Parity tests need torch and transformers ({e}); CI must install the workspace's `parity` "
                "dependency group (`uv sync --all-groups`)."
            )
        pytest.skip(f"torch/transformers not installed ({e}); `uv sync --all-groups` installs them")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return SimpleNamespace(torch=torch, transformers=transformers)


def token_ids(vocab: int, length: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    """Random token ids of shape (batch, length)."""
    return np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int64)


def hf_logits(hf, model, ids: np.ndarray) -> np.ndarray:
    """A transformers model's logits (batch, position, vocab) as float32 numpy."""
    with hf.torch.no_grad():
        return model(hf.torch.tensor(ids)).logits.float().numpy()


def _forward(model, ids):
    # One compiled program is much faster here than running the model op by op.
    import equinox as eqx

    return eqx.filter_jit(lambda m, x: m(x))(model, ids)


def our_logits(model, ids: np.ndarray) -> np.ndarray:
    """An lm_models model's logits (batch, position, vocab) as float32 numpy."""
    out = _forward(model, nt.named(jnp.asarray(ids, jnp.int32), ("batch", "position")))
    return np.asarray(nt.permute(out, ("batch", "position", "vocab")).array, np.float32)


def random_hf_model(hf, config, seed: int = 0):
    """A transformers causal LM with random weights for `config`, in eval mode (no dropout), float32.

    Norm weights and biases are randomised too, so that a mix-up between them cannot pass unnoticed.
    """
    hf.torch.manual_seed(seed)
    model = hf.transformers.AutoModelForCausalLM.from_config(config).eval()
    with hf.torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * hf.torch.randn_like(p) if name.endswith("weight") else 0.1 * hf.torch.randn_like(p))
    return model


def assert_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    """Logits agree within TOLERANCE (max abs difference)."""
    assert ours.shape == theirs.shape
    diff = float(np.max(np.abs(ours - theirs)))
    assert diff <= TOLERANCE, f"max |ours - transformers| = {diff}"


@pytest.fixture
def ids_for():
    return token_ids


@pytest.fixture
def parity():
    """Helpers: hf_logits, our_logits, random_hf_model, assert_close."""
    return SimpleNamespace(
        hf_logits=hf_logits, our_logits=our_logits, random_hf_model=random_hf_model, assert_close=assert_close
    )


def random_model(config, vocab_size: int, seed: int = 0):
    """A model of ours with random normal weights, made without running its (slow, eager) initialiser."""
    import equinox as eqx
    import jax

    rng = np.random.default_rng(seed)
    Vocab = nt.Axis("vocab", vocab_size)
    shapes = eqx.filter_eval_shape(lambda: config.build(Vocab, key=jax.random.key(0)))

    def fill(leaf):
        values = rng.normal(0.0, 0.2, tuple(a.size for a in leaf.axes)).astype(np.float32)
        return nt.NamedArray(jnp.asarray(values), leaf.axes)

    return jax.tree.map(fill, shapes, is_leaf=nt.is_named)


@pytest.fixture(scope="session")
def make_model():
    """random_model(config, vocab_size, seed=0): a model of ours with random weights."""
    return random_model


@pytest.fixture(scope="session")
def tiny_gpt2():
    """A small random GPT-2 of ours (no torch needed) and its config."""
    import lm_models

    config = lm_models.Gpt2Config(seq_len=12, hidden_dim=24, num_layers=2, num_heads=3)
    return random_model(config, 41), config
