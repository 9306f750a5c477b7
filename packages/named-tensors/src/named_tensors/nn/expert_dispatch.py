"""Expert parallelism: tokens go to the devices that hold their experts with an all-to-all, and come back.

When the axis mapping sends the `experts` axis to mesh axes of more than one device, each device keeps its slice
of the experts and routes its own tokens: it packs every token, once per destination device that holds one of the
token's k experts, into that device's send buffer; one all-to-all delivers the buffers; each device runs its
local experts on what it received and weights their outputs by the router's weights; the inverse all-to-all
returns the rows, and each token sums the parts that came back (the combine).

jax.lax.ragged_all_to_all would send only the filled rows, but XLA:CPU does not implement it (jax 0.10.2:
"HLO opcode `ragged-all-to-all` is not supported by XLA:CPU"), so the buffers have a fixed size. The MoE layer
drops no token, so a buffer must hold the worst case, every local token: a token is sent to a device at most once
whatever the number of its experts there, so that is T rows per destination and never more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._core import Axis
from .._sharding import current_axis_mapping, current_mesh
from .device_view import DeviceView, device_view

# run(x, ids, weights, params, first_expert) -> (T, H): the router-weighted sum of the outputs of the experts
# first_expert .. first_expert + len(params[0]) - 1 for each row; the other experts' choices contribute nothing.
LocalExperts = Callable[[jax.Array, jax.Array, jax.Array, Sequence[jax.Array], Any], jax.Array]


def expert_mesh_axes(experts: str) -> tuple[str, ...]:
    """The mesh axes that the current axis mapping splits `experts` over (empty without a mapping or a mesh)."""
    view = device_view()
    if view is not None:
        return view.mesh_axes(experts)
    mapping, mesh = current_axis_mapping(), current_mesh()
    if mapping is None or mesh is None:
        return ()
    return tuple(a for a in _mesh_axes(mapping, experts) if a in mesh.shape)


def dispatch_experts(
    run: LocalExperts,
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    params: Sequence[jax.Array],
    token_axes: Sequence[Axis],
    *,
    experts: str = "experts",
) -> jax.Array:
    """run over every expert for the tokens x (T, H) with their ids and weights (T, k): on this device when the
    experts are not split over devices, else with each device's tokens sent to its experts by all-to-all."""
    view = device_view()
    if view is not None and view.mesh_axes(experts):
        return _one_device(view, run, x, ids, weights, params, token_axes, experts)
    mesh = current_mesh()
    ep = expert_mesh_axes(experts)
    devices = math.prod(mesh.shape[a] for a in ep) if mesh is not None and ep else 1
    if devices == 1:
        return run(x, ids, weights, params, 0)
    assert mesh is not None  # ep is empty without a mesh
    mapping = current_axis_mapping()
    num_experts = params[0].shape[0]
    if num_experts % devices:
        raise ValueError(
            f"The axis mapping splits {num_experts} experts over mesh axes {ep} of {devices} devices, which does "
            f"not divide them; map `experts` to mesh axes whose size divides {num_experts}"
        )
    # The merged token dimension keeps the sharding of the first token axis (batch-like): a contiguous block of
    # tokens per device. Expert axes that do not split the tokens hold copies of them: each copy takes a slice.
    token_mesh = tuple(a for a in _mesh_axes(mapping, token_axes[0].name) if a in mesh.shape)
    copies = tuple(a for a in ep if a not in token_mesh)
    n_copies = math.prod(mesh.shape[a] for a in copies)
    t_spec = PartitionSpec(token_mesh or None, None)
    w_specs = tuple(PartitionSpec(ep, *(None,) * (p.ndim - 1)) for p in params)  # each split over its experts
    local_experts = num_experts // devices

    def local(x, ids, weights, *local_params):
        T = x.shape[0]
        if copies:
            x, ids, weights = _my_slice(x, ids, weights, copies, n_copies)

        def send(a):
            return jax.lax.all_to_all(a, ep, 0, 0, tiled=True)

        out = _exchange(run, x, ids, weights, local_params, send, jax.lax.axis_index(ep), devices, local_experts)
        if copies:
            out = jax.lax.all_gather(out, copies, axis=0, tiled=True)[:T]
        return out

    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(t_spec, t_spec, t_spec, *w_specs),
        out_specs=t_spec,
        check_vma=False,
    )
    return fn(x, ids, weights, *params)


def _one_device(view: DeviceView, run: LocalExperts, x, ids, weights, params, token_axes, experts: str) -> jax.Array:
    """One device's dispatch under nn.one_device: x, ids and weights are its tokens, params its experts; the
    view's exchange stands for the all-to-alls and its gather for the copies' all-gather."""
    ep = view.mesh_axes(experts)
    devices = math.prod(view.mesh_shape[a] for a in ep)
    token_mesh = view.mesh_axes(token_axes[0].name)
    copies = tuple(a for a in ep if a not in token_mesh)
    n_copies = math.prod(view.mesh_shape[a] for a in copies)
    T = x.shape[0]
    if copies:
        x, ids, weights = _my_slice(x, ids, weights, copies, n_copies, start=0)
    out = _exchange(run, x, ids, weights, params, view.exchange, 0, devices, params[0].shape[0])
    if copies:
        out = view.gather(out, 0, n_copies)[:T]
    return out


def _my_slice(x, ids, weights, copies: tuple[str, ...], n: int, start: Any = None):
    """This device's 1/n of tokens that the `copies` axes replicate (padded with tokens that choose no expert)."""
    T = x.shape[0]
    pad = -T % n
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        ids = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=-1)
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
    size = (T + pad) // n
    start = (jax.lax.axis_index(copies) if start is None else start) * size
    return tuple(jax.lax.dynamic_slice_in_dim(a, start, size, axis=0) for a in (x, ids, weights))


def _exchange(
    run: LocalExperts, x, ids, weights, params, all_to_all: Callable, index: Any, devices: int, local_experts: int
):
    """Inside shard_map: send this device's tokens to their experts' devices (`all_to_all` over the expert axes,
    on which this device is `index`), run the local experts on what arrives, send the results back, and sum each
    token's parts."""
    T, H = x.shape
    # owner: the device of each chosen expert (-1 for padding tokens, which choose none).
    owner = jnp.where(ids >= 0, ids // local_experts, -1)
    to_device = jnp.any(owner[:, :, None] == jnp.arange(devices, dtype=ids.dtype)[None, None, :], axis=1)  # (T, D)
    # Pack: a token's row in a destination's buffer is its rank among the tokens sent there.
    rank = jnp.cumsum(to_device, axis=0, dtype=jnp.int32) - 1
    capacity = T  # dropless: every token may choose the same device
    row = jnp.where(to_device, jnp.arange(devices, dtype=jnp.int32)[None, :] * capacity + rank, devices * capacity)
    row = row.reshape(T * devices)
    token = jnp.repeat(jnp.arange(T, dtype=jnp.int32), devices)

    def pack(values, fill):
        buffer = jnp.full((devices * capacity, *values.shape[1:]), fill, values.dtype)
        return buffer.at[row].set(values[token], mode="drop", unique_indices=True)

    sent_x, sent_ids, sent_weights = (all_to_all(pack(v, fill)) for v, fill in ((x, 0), (ids, -1), (weights, 0)))
    first = index * local_experts
    y = run(
        sent_x, sent_ids, sent_weights, params, first
    )  # (D * capacity, H): each received row's weighted sum over the local experts
    back = all_to_all(y)
    parts = jnp.take(back, row, axis=0, mode="fill", fill_value=0).reshape(T, devices, H)
    return parts.sum(axis=1)


def _mesh_axes(mapping, name: str) -> tuple[str, ...]:
    value = mapping.get(name) if mapping is not None else None
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


__all__ = ["dispatch_experts", "expert_mesh_axes"]
