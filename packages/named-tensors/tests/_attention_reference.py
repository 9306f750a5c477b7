"""Shared by the attention tests: a direct softmax(QK^T/sqrt(d) + bias, masked)V in plain jax.numpy, and a walk
over a jaxpr's equations."""

import jax.numpy as jnp


def reference_attention(q, k, v, allowed=None, bias=None, scale=None, soft_cap=None):
    """q (B,T,H,D), k/v (B,S,Hkv,D) with H a multiple of Hkv; allowed/bias broadcastable to (B,H,T,S);
    soft_cap: cap * tanh(s / cap) on the scaled scores s."""
    group = q.shape[2] // k.shape[2]
    # Query head h reads kv head h // group: repeating each kv head `group` times in place gives that.
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1])) if scale is None else scale
    s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = jnp.where(allowed, s, -jnp.inf)
    s = s - jnp.max(s, axis=-1, keepdims=True)
    w = jnp.exp(s)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    return jnp.einsum("bhts,bshd->bthd", w, v)


def all_jaxpr_eqns(jaxpr, skip=()):
    """Every equation of a jaxpr, those of the jaxprs nested in its equations' parameters included, except inside
    the equations whose primitive is named in `skip` (e.g. a Pallas kernel's body, which works on on-chip blocks)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in skip:
            continue
        for param in eqn.params.values():
            for inner in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr holds its Jaxpr
                if hasattr(inner, "eqns"):
                    yield from all_jaxpr_eqns(inner, skip)
