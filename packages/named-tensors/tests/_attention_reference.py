"""A direct softmax(QK^T/sqrt(d) + bias, masked)V in plain jax.numpy, shared by the attention tests."""

import jax.numpy as jnp


def reference_attention(q, k, v, allowed=None, bias=None, scale=None):
    """q (B,T,H,D), k/v (B,S,Hkv,D) with H a multiple of Hkv; allowed/bias broadcastable to (B,H,T,S)."""
    group = q.shape[2] // k.shape[2]
    # Query head h reads kv head h // group: repeating each kv head `group` times in place gives that.
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1])) if scale is None else scale
    s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = jnp.where(allowed, s, -jnp.inf)
    s = s - jnp.max(s, axis=-1, keepdims=True)
    w = jnp.exp(s)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    return jnp.einsum("bhts,bshd->bthd", w, v)
