"""SOAP against a plain jax.numpy reference of the paper's Algorithm 3, block by block; its layouts and config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optim_reference import flat, run_optimizer

import named_tensors as nt
from lm_train.config import SoapConfig
from lm_train.errors import ConfigError
from lm_train.optim import build_optimizer
from lm_train.optim.soap import block_layout, soap

Layers, Heads, Embed, Mlp = nt.Axis("layers", 2), nt.Axis("heads", 3), nt.Axis("embed", 8), nt.Axis("mlp", 6)
Embed4 = nt.Axis("embed", 4)


def _params(seed: int) -> dict:
    rng = np.random.default_rng(seed)

    def named(*axes):
        return nt.NamedArray(jnp.asarray(rng.normal(size=[a.size for a in axes]).astype(np.float32)), axes)

    return {"w": named(Embed, Mlp), "stacked": named(Layers, Heads, Embed4), "norm": named(Embed)}


# With block_size 4 and max_precond_dim 5: w's embed (8) is cut into two blocks of 4 rows, each with a 4 x 4
# factor, and its mlp (6, not a multiple of 4, and above 5) has none; each layer of `stacked` is one block with a
# factor on both dimensions; the norm is plain Adam.
def _blocks(p: dict) -> dict[str, jnp.ndarray]:
    w, s = p["w.0"], p["stacked.0"]
    return {"w0": w[:4], "w1": w[4:], "s0": s[0], "s1": s[1], "norm": p["norm.0"]}


def _unblock(b: dict) -> dict[str, np.ndarray]:
    return {
        "w.0": np.concatenate([b["w0"], b["w1"]]),
        "stacked.0": np.stack([b["s0"], b["s1"]]),
        "norm.0": np.asarray(b["norm"]),
    }


FACTORED = {"w0": (True, False), "w1": (True, False), "s0": (True, True), "s1": (True, True), "norm": ()}


def reference_soap(params0, grads, *, lr, b1, b2, shampoo_beta, eps, frequency, wd, decayed):
    """Algorithm 3 of Vyas et al. (2024), with the official code's first call that only starts the factors."""
    p = {k: jnp.asarray(v) for k, v in _blocks(params0).items()}
    m = {k: jnp.zeros_like(v) for k, v in p.items()}
    v = {k: jnp.zeros_like(x) for k, x in p.items()}
    L = {k: [jnp.zeros((d, d)) if f else None for d, f in zip(p[k].shape, FACTORED[k], strict=False)] for k in p}
    Q = {k: [None for _ in FACTORED[k]] for k in p}

    def rotate(x, qs, back):
        ql, qr = [*qs, None, None][:2]
        if ql is not None:
            x = (ql if back else ql.T) @ x
        if qr is not None:
            x = x @ (qr.T if back else qr)
        return x

    history = []
    for call, g in enumerate(grads):
        g = {k: jnp.asarray(x) for k, x in _blocks(g).items()}
        for k in p:
            update = jnp.zeros_like(p[k])
            if call > 0:
                t = call
                m[k] = b1 * m[k] + (1 - b1) * g[k]
                v[k] = b2 * v[k] + (1 - b2) * rotate(g[k], Q[k], back=False) ** 2
                adam = (rotate(m[k], Q[k], back=False) / (1 - b1**t)) / (jnp.sqrt(v[k] / (1 - b2**t)) + eps)
                update = rotate(adam, Q[k], back=True)
            if FACTORED[k]:
                grams = [g[k] @ g[k].T, g[k].T @ g[k]]
                L[k] = [
                    None if f is None else shampoo_beta * f + (1 - shampoo_beta) * gg
                    for f, gg in zip(L[k], grams, strict=True)
                ]
                if call % frequency == 0:
                    Q[k] = [None if f is None else jnp.linalg.eigh(f)[1] for f in L[k]]
            decay = wd * p[k] if k.rstrip("01") in decayed else 0.0
            p[k] = p[k] - lr(call) * (update + decay)
        history.append(_unblock(p))
    return history


def test_update_matches_a_plain_jnp_reference_over_steps():
    lr = optax.linear_schedule(0.02, 0.005, 7)
    settings = dict(b1=0.9, b2=0.95, shampoo_beta=0.8, eps=1e-8)
    optimizer = soap(
        lr,
        weight_decay=0.1,
        mask={"w": True, "stacked": True, "norm": False},
        **settings,
        precondition_frequency=3,
        max_precond_dim=5,
        merge_small_dims=False,
        partition_grads_into_blocks=True,
        block_size=4,
    )
    params = _params(0)
    rng = np.random.default_rng(1)
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), params) for _ in range(7)]
    got = run_optimizer(optimizer, params, grads)
    want = reference_soap(
        flat(params),
        [flat(g) for g in grads],
        lr=lr,
        frequency=3,
        wd=0.1,
        decayed={"w", "s"},
        **settings,
    )
    for step, (got_step, want_step) in enumerate(zip(got, want, strict=True)):
        assert got_step.keys() == want_step.keys()
        for k in want_step:
            np.testing.assert_allclose(got_step[k], want_step[k], rtol=0, atol=1e-6, err_msg=f"{k} at step {step}")
    # The rotation matters: Adam on the same gradients ends elsewhere.
    adam = run_optimizer(optax.chain(optax.scale_by_adam(0.9, 0.95), optax.scale(-0.02)), params, grads[1:])[-1]
    assert np.abs(adam["w.0"] - got[-1]["w.0"]).max() > 1e-3


def test_block_layout_merges_cuts_and_round_trips():
    x = nt.NamedArray(
        jnp.arange(2 * 3 * 4 * 512, dtype=jnp.float32).reshape(2, 3, 4, 512),
        (Layers, Heads, nt.Axis("head_size", 4), nt.Axis("embed", 512)),
    )
    layout = block_layout(
        x,
        max_precond_dim=10000,
        merge_small_dims=True,
        target_merged_dim_size=16,
        partition_grads_into_blocks=True,
        block_size=256,
    )
    # layers is a batch; heads x head_size merge into 12; embed (512) is cut into two blocks of 256.
    assert layout.merged == (12, 512) and layout.blocks == (1, 2) and layout.block == (12, 256)
    assert layout.count == 4 and layout.factored == (True, True)
    blocks = layout.to_blocks(x.array)
    assert blocks.shape == (4, 12, 256)
    np.testing.assert_array_equal(blocks[1], x.array[0].reshape(12, 512)[:, 256:])
    np.testing.assert_array_equal(layout.from_blocks(blocks, x.array.shape), x.array)
    # A bias is plain Adam; a dimension over max_precond_dim gets no factor.
    assert block_layout(
        nt.NamedArray(jnp.zeros(8), (Embed,)),
        max_precond_dim=5,
        merge_small_dims=False,
        target_merged_dim_size=1,
        partition_grads_into_blocks=False,
        block_size=4,
    ).factored == (False,)


def test_config_with_levanter_keys_builds_soap():
    config = SoapConfig(learning_rate=0.01, warmup=0, precondition_frequency=2, block_size=4)
    optimizer, _ = build_optimizer(config, 10)
    params = _params(2)
    rng = np.random.default_rng(3)
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), params) for _ in range(3)]
    got = run_optimizer(optimizer, params, grads)
    assert all(np.isfinite(v).all() for v in got[-1].values())
    np.testing.assert_array_equal(got[0]["w.0"], flat(params)["w.0"])  # the first call only starts the factors


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"beta2": 1.5}, r"optimizer.beta2 must be in \[0, 1\)"),
        ({"shampoo_beta": 1.0}, "optimizer.shampoo_beta must be below 1"),
        ({"precondition_frequency": 0}, "optimizer.precondition_frequency must be at least 1.*e.g. 10"),
        ({"block_size": 0}, "optimizer.block_size must be at least 1"),
        ({"max_precond_dim": -3}, "optimizer.max_precond_dim must be at least 1"),
    ],
)
def test_config_errors_name_the_key_and_the_fix(changes, message):
    with pytest.raises(ConfigError, match=message):
        SoapConfig(**changes)
