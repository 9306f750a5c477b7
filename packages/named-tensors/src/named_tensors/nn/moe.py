"""Mixture of experts: top-k routing, its auxiliary losses, and dropless dispatch of tokens to expert MLPs.

Dispatch never builds a dense (tokens, experts, hidden) tensor. The k choices of every token are sorted by
expert; each expert's run is padded to a multiple of a block of rows, so that every block belongs to one expert;
a scan then multiplies each block by its expert's weights and skips the blocks past the last filled one. Memory
is O(tokens * k * hidden) and compute is that of the chosen experts plus at most one partly filled block per
expert. No token is ever dropped (there is no capacity), so the result equals the dense definition
sum_k weight_k * expert_{id_k}(x).

Expert parallelism: when the current axis mapping (nt.axis_mapping) sends the `experts` axis to mesh axes of
more than one device, each device keeps only its slice of the experts and its tokens travel to them by
all-to-all and back (expert_dispatch). Without such a mapping the same code runs under plain GSPMD.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from .. import _ops as ops
from .._core import Axis, AxisSelector, NamedArray, axis_name, permute
from .._indexing import top_k
from .._layer_names import DEFAULT_MOE_BLOCK_SIZE
from .._reshape import flatten_axes, unflatten_axis
from ._checks import require_axes
from .activations import _ACTIVATIONS, activation_fn
from .expert_dispatch import dispatch_experts
from .linear import Linear

EXPERTS = "experts"
TOP_EXPERTS = "top_experts"
ROUTER_LOAD = "router_load"
"""The aux key under which a mixture reports its load (expert_load): a statistic, not a loss."""
_TOKEN = "token"
# Rows per block of the grouped matmul: large enough for efficient matmuls, small enough that padding each
# expert's run to a block costs little.
DEFAULT_BLOCK_SIZE = DEFAULT_MOE_BLOCK_SIZE


def top_k_routing(
    router_logits: NamedArray,
    Experts: AxisSelector,
    k: int,
    *,
    TopExperts: AxisSelector = TOP_EXPERTS,
    normalize: bool = True,
) -> tuple[NamedArray, NamedArray]:
    """Mixtral's routing: softmax over Experts (float32), the k largest, renormalised to sum to one.

    With normalize=False the k probabilities are kept as they are (Qwen3-MoE's norm_topk_prob=false).
    Returns (weights, expert ids), both with Experts replaced by TopExperts (size k); ids are int32.
    """
    probs = ops.softmax(router_logits.astype(jnp.float32), Experts)
    weights, ids = top_k(probs, Experts, k, new_axis=TopExperts)
    if normalize:
        weights = weights / ops.sum(weights, TopExperts)
    return weights, ids.astype(jnp.int32)


def load_balancing_loss(
    router_logits: NamedArray, expert_ids: NamedArray, Experts: AxisSelector, *, TopExperts: AxisSelector = TOP_EXPERTS
) -> jax.Array:
    """The Switch/Mixtral auxiliary loss: num_experts * sum_e f_e * P_e, a float32 scalar.

    f_e is the fraction of tokens that chose expert e among their k (so the f_e sum to k), P_e the mean router
    probability of e; every other axis of the logits counts as tokens. Perfectly balanced routing gives k.
    """
    E = router_logits.resolve_axis(Experts)
    probs = ops.softmax(router_logits.astype(jnp.float32), E)
    token_axes = [a for a in probs.axes if a.name != E.name]
    one_hot = NamedArray(jax.nn.one_hot(expert_ids.array, E.size, dtype=jnp.float32), (*expert_ids.axes, E))
    chosen = ops.sum(one_hot, TopExperts)
    fraction = ops.mean(chosen, token_axes) if token_axes else chosen
    mean_prob = ops.mean(probs, token_axes) if token_axes else probs
    return (E.size * ops.sum(fraction * mean_prob, E)).array


def expert_load(expert_ids: NamedArray, Experts: Axis) -> NamedArray:
    """The fraction of all routed choices (every axis of expert_ids) that went to each expert: axis Experts,
    summing to one."""
    ids = expert_ids.array.reshape(-1)
    counts = jnp.zeros((Experts.size,), jnp.float32).at[ids].add(1.0)
    return NamedArray(counts / ids.size, (Experts,))


def router_z_loss(router_logits: NamedArray, Experts: AxisSelector) -> jax.Array:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)², a float32 scalar."""
    lse = ops.logsumexp(router_logits.astype(jnp.float32), Experts)
    return jnp.mean(jnp.square(lse.array))


class GatedExperts(eqx.Module):
    """E gated MLPs, down(act(gate(x)) * up(x)), with their weights stacked along an `experts` axis.

    Layouts: `gate` and `up` (experts, mlp, embed), `down` (experts, embed, mlp): each expert's slice is a
    PyTorch nn.Linear weight (out, in). With biases, `gate_bias` and `up_bias` (experts, mlp) and `down_bias`
    (experts, embed). With `swiglu_limit` (gpt-oss's clamped SwiGLU), the hidden units are
    (clip(up, -limit, limit) + 1) * g * sigmoid(swiglu_alpha * g) with g = min(gate, limit), and `activation`
    is not used.
    """

    gate: NamedArray
    up: NamedArray
    down: NamedArray
    activation: str = eqx.field(static=True)
    gate_bias: NamedArray | None = None
    up_bias: NamedArray | None = None
    down_bias: NamedArray | None = None
    swiglu_limit: float | None = eqx.field(static=True, default=None)
    swiglu_alpha: float = eqx.field(static=True, default=1.0)

    @staticmethod
    def init(
        Experts: Axis,
        Embed: Axis,
        Mlp: Axis,
        *,
        key: jax.Array,
        activation: str = "silu",
        init_scale: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        use_bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.0,
    ) -> GatedExperts:
        """Weights ~ Normal(0, init_scale), biases (with use_bias) zero."""
        activation_fn(activation)
        if swiglu_limit is not None and not swiglu_limit > 0:
            raise ValueError(f"GatedExperts: swiglu_limit must be positive (or None), got {swiglu_limit!r}")
        kg, ku, kd = jax.random.split(key, 3)

        def draw(k: jax.Array, axes: tuple[Axis, ...]) -> NamedArray:
            values = jax.random.normal(k, tuple(a.size for a in axes), jnp.float32) * init_scale
            return NamedArray(values.astype(dtype), axes)

        def zeros(*axes: Axis) -> NamedArray | None:
            return NamedArray(jnp.zeros(tuple(a.size for a in axes), dtype), axes) if use_bias else None

        return GatedExperts(
            draw(kg, (Experts, Mlp, Embed)),
            draw(ku, (Experts, Mlp, Embed)),
            draw(kd, (Experts, Embed, Mlp)),
            activation,
            zeros(Experts, Mlp),
            zeros(Experts, Mlp),
            zeros(Experts, Embed),
            swiglu_limit,
            swiglu_alpha,
        )

    @property
    def Experts(self) -> Axis:
        return self.gate.resolve_axis(EXPERTS)

    def __call__(
        self,
        x: NamedArray,
        expert_ids: NamedArray,
        weights: NamedArray,
        *,
        Embed: AxisSelector = "embed",
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> NamedArray:
        """sum over TopExperts of weights * expert_{expert_ids}(x), for every token (every axis of x but Embed).

        expert_ids and weights have x's token axes plus `top_experts`.
        """
        require_axes(x, Embed, "GatedExperts")
        E = axis_name(Embed)
        token_axes = [a for a in x.axes if a.name != E]
        names = [a.name for a in token_axes]
        flat = _flat_tokens(x, names, (E,))
        ids = _flat_tokens(expert_ids, names, (TOP_EXPERTS,)).array
        w = _flat_tokens(weights, names, (TOP_EXPERTS,)).array.astype(x.dtype)
        mlp = next(a.name for a in self.gate.axes if a.name not in (EXPERTS, E))
        params = [
            permute(self.gate, (EXPERTS, mlp, E)).array,
            permute(self.up, (EXPERTS, mlp, E)).array,
            permute(self.down, (EXPERTS, E, mlp)).array,
        ]
        if self.gate_bias is not None:
            assert self.up_bias is not None and self.down_bias is not None  # biased experts have all three
            params += [
                permute(self.gate_bias, (EXPERTS, mlp)).array,
                permute(self.up_bias, (EXPERTS, mlp)).array,
                permute(self.down_bias, (EXPERTS, E)).array,
            ]
        run = _Dispatch(self.activation, block_size, self.swiglu_limit, self.swiglu_alpha)
        out = dispatch_experts(run, flat.array, ids, w, params, token_axes, experts=EXPERTS)
        y = unflatten_axis(NamedArray(out, (flat.axes[0], x.resolve_axis(E))), _TOKEN, token_axes)
        return permute(y, x.axis_names)


def _flat_tokens(x: NamedArray, token_names: list[str], rest: tuple[str, ...]) -> NamedArray:
    """x with its token axes merged into one `token` axis, laid out (token, *rest)."""
    return flatten_axes(permute(x, (*token_names, *rest)), token_names, _TOKEN)


class MixtureOfExperts(eqx.Module):
    """A router (embed -> experts; a bias for gpt-oss) choosing k of E gated experts per token, Mixtral's sparse
    MoE block.

    Calling it gives (output, aux): aux maps "router_aux_loss" (load_balancing_loss) and, when `z_loss`,
    "router_z_loss" to float32 scalars for this call, and ROUTER_LOAD to its expert_load (experts,). Dispatch is
    dropless, so there is no count of dropped tokens to report. `normalize_weights` renormalises the k chosen
    probabilities to sum to one (top_k_routing's `normalize`).
    """

    router: Linear
    experts: GatedExperts
    num_experts_per_token: int = eqx.field(static=True)
    z_loss: bool = eqx.field(static=True, default=False)
    block_size: int = eqx.field(static=True, default=DEFAULT_BLOCK_SIZE)
    normalize_weights: bool = eqx.field(static=True, default=True)

    @staticmethod
    def init(
        Embed: Axis,
        Experts: Axis,
        Mlp: Axis,
        num_experts_per_token: int,
        *,
        key: jax.Array,
        activation: str = "silu",
        init_scale: float = 0.02,
        z_loss: bool = False,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: DTypeLike = jnp.float32,
        normalize_weights: bool = True,
        router_bias: bool = False,
        expert_bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.0,
    ) -> MixtureOfExperts:
        """A router and experts with weights ~ Normal(0, init_scale) (biases, where asked for, zero; the experts'
        options are GatedExperts')."""
        if not 1 <= num_experts_per_token <= Experts.size:
            raise ValueError(
                f"MixtureOfExperts: num_experts_per_token={num_experts_per_token} must be between 1 and the "
                f"number of experts {Experts.size}"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"MixtureOfExperts: block_size must be a positive int, got {block_size!r}")
        k_router, k_experts = jax.random.split(key)
        router = Linear.init(
            Embed, Experts, key=k_router, use_bias=router_bias, init_scale=init_scale, scale_by_fan_in=False,
            dtype=dtype,
        )  # fmt: skip
        experts = GatedExperts.init(
            Experts, Embed, Mlp, key=k_experts, activation=activation, init_scale=init_scale, dtype=dtype,
            use_bias=expert_bias, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha,
        )  # fmt: skip
        return MixtureOfExperts(router, experts, num_experts_per_token, z_loss, block_size, normalize_weights)

    def __call__(self, x: NamedArray) -> tuple[NamedArray, dict[str, jax.Array]]:
        """The experts' weighted output for every token of x, and this call's auxiliary losses."""
        Embed = self.router.In[0]
        Experts = self.router.Out[0]
        logits = self.router(x)
        weights, ids = top_k_routing(logits, Experts, self.num_experts_per_token, normalize=self.normalize_weights)
        out = self.experts(x, ids, weights, Embed=Embed, block_size=self.block_size)
        aux = {"router_aux_loss": load_balancing_loss(logits, ids, Experts)}
        if self.z_loss:
            aux["router_z_loss"] = router_z_loss(logits, Experts)
        aux[ROUTER_LOAD] = expert_load(ids, Experts).array
        return out, aux


class _Dispatch(eqx.Module):
    """The grouped gated MLP on positional arrays: x (T, H), ids and weights (T, k), local experts' weights."""

    activation: str = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    swiglu_limit: float | None = eqx.field(static=True, default=None)
    swiglu_alpha: float = eqx.field(static=True, default=1.0)

    def __call__(self, x, ids, weights, params, first_expert) -> jax.Array:
        w_gate, w_up, w_down = params[:3]  # (E, I, H), (E, I, H), (E, H, I): this device's experts
        biases = params[3:]  # (E, I), (E, I), (E, H) when the experts have biases
        T, k = ids.shape
        H, E = x.shape[-1], w_gate.shape[0]
        A = T * k
        # Blocks no larger than an even share of the rows, so that small inputs are not padded up to 128 rows.
        B = max(1, min(self.block_size, -(-A // E)))
        n_blocks = -(-(A + E * (B - 1)) // B)  # enough for every expert's run padded to whole blocks
        local = ids.reshape(A) - first_expert
        is_local = (local >= 0) & (local < E)
        group = jnp.where(is_local, local, E)  # other devices' experts sort last and are never placed
        order = jnp.argsort(group, stable=True)
        group_sorted = group[order]
        token = order // k
        counts = jnp.zeros(E + 1, jnp.int32).at[group].add(1)[:E]
        starts = jnp.cumsum(counts) - counts
        padded = (counts + B - 1) // B * B
        padded_ends = jnp.cumsum(padded)
        padded_starts = padded_ends - padded
        g = jnp.minimum(group_sorted, E - 1)
        rank = jnp.arange(A, dtype=jnp.int32) - starts[g]
        dest = jnp.where(group_sorted < E, padded_starts[g] + rank, n_blocks * B)  # out of range: dropped
        rows = jnp.zeros((n_blocks * B, H), x.dtype).at[dest].set(x[token], mode="drop", unique_indices=True)
        block_starts = jnp.arange(n_blocks, dtype=jnp.int32) * B
        block_expert = jnp.minimum(jnp.searchsorted(padded_ends, block_starts, side="right"), E - 1)
        filled = padded_ends[-1]
        act = _ACTIVATIONS[self.activation]

        def one_block(_, xs):
            rows_b, e, start = xs

            def compute(rows_b):
                gate = rows_b @ w_gate[e].T
                up = rows_b @ w_up[e].T
                if biases:  # one bias row for the block's rows
                    gate, up = gate + biases[0][e][None, :], up + biases[1][e][None, :]
                if self.swiglu_limit is None:
                    hidden = act(gate) * up
                else:
                    limit = self.swiglu_limit
                    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
                    hidden = gate * jax.nn.sigmoid(self.swiglu_alpha * gate) * (up + 1)
                out = hidden @ w_down[e].T
                return out + biases[2][e][None, :] if biases else out

            out = jax.lax.cond(start < filled, compute, jnp.zeros_like, rows_b)
            return None, out

        _, out = jax.lax.scan(one_block, None, (rows.reshape(n_blocks, B, H), block_expert, block_starts))
        y = jnp.take(out.reshape(n_blocks * B, H), dest, axis=0, mode="fill", fill_value=0)
        w = jnp.where(group_sorted < E, weights.reshape(A)[order], 0).astype(x.dtype)
        return jnp.zeros((T, H), x.dtype).at[token].add(y * w[:, None])


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "EXPERTS",
    "ROUTER_LOAD",
    "TOP_EXPERTS",
    "GatedExperts",
    "MixtureOfExperts",
    "expert_load",
    "load_balancing_loss",
    "router_z_loss",
    "top_k_routing",
]
