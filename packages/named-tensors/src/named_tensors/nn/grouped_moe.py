"""DeepSeek-V3's mixture of experts: sigmoid scores, group-limited top-k chosen with a per-expert bias that only
steers the choice, scaled weights, always-on shared experts, and the sequence-wise balance loss.

The routed experts run through GatedExperts' dropless dispatch (nn.moe), so expert parallelism applies as there.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from .._core import Axis, AxisSelector, NamedArray, axis_name, permute
from ._checks import require_axes
from .linear import Linear
from .mlp import GatedMLP
from .moe import DEFAULT_BLOCK_SIZE, EXPERTS, ROUTER_LOAD, TOP_EXPERTS, GatedExperts, expert_load

POSITION = "position"


def group_limited_routing(
    router_logits: NamedArray,
    Experts: AxisSelector,
    k: int,
    *,
    correction_bias: NamedArray | None = None,
    num_groups: int = 1,
    top_groups: int = 1,
    normalize: bool = True,
    scaling_factor: float = 1.0,
    TopExperts: AxisSelector = TOP_EXPERTS,
) -> tuple[NamedArray, NamedArray]:
    """DeepSeek-V3's routing: (weights, expert ids), both with Experts replaced by TopExperts (size k).

    Scores are sigmoid(logits) in float32. The choice uses scores + correction_bias (axis Experts; zero when
    None): the experts are cut into num_groups equal groups, each group is rated by the sum of its two best
    biased scores, and the k experts are picked among the top_groups best groups. The weights are the chosen
    experts' unbiased scores, divided by their sum when `normalize`, then times scaling_factor.
    """
    E = router_logits.resolve_axis(Experts)
    if not 1 <= top_groups <= num_groups or E.size % num_groups or E.size // num_groups < 2:
        raise ValueError(
            f"group_limited_routing: {E.size} experts must split into num_groups={num_groups} equal groups of at "
            f"least 2, and top_groups={top_groups} must be between 1 and num_groups"
        )
    if not 1 <= k <= E.size * top_groups // num_groups:
        raise ValueError(
            f"group_limited_routing: k={k} must be between 1 and the {E.size * top_groups // num_groups} experts of "
            "the chosen groups"
        )
    moved = permute(router_logits, (..., E.name))
    scores = jax.nn.sigmoid(moved.array.astype(jnp.float32))
    choice = scores
    if correction_bias is not None:
        bias = jax.lax.stop_gradient(correction_bias.array.astype(jnp.float32))
        choice = scores + bias.reshape((1,) * (scores.ndim - 1) + (E.size,))
    grouped = choice.reshape(*choice.shape[:-1], num_groups, E.size // num_groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best_groups = jax.lax.top_k(group_scores, top_groups)
    in_best = jnp.sum(jax.nn.one_hot(best_groups, num_groups, dtype=jnp.int32), axis=-2) > 0
    allowed = jnp.repeat(in_best, E.size // num_groups, axis=-1)
    _, ids = jax.lax.top_k(jnp.where(allowed, choice, -jnp.inf), k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    Top = Axis(axis_name(TopExperts), k)
    out_axes = (*moved.axes[:-1], Top)
    return NamedArray(weights * scaling_factor, out_axes), NamedArray(ids.astype(jnp.int32), out_axes)


def sequence_balance_loss(
    router_logits: NamedArray, expert_ids: NamedArray, Experts: AxisSelector, *, Pos: AxisSelector = POSITION
) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss, float32: per sequence, sum_e f_e * P_e with
    f_e = E / (k * T) * (tokens choosing e) and P_e the mean of e's sigmoid score normalised over the experts;
    averaged over the sequences (every axis but Pos and Experts). 1 when perfectly balanced."""
    E = router_logits.resolve_axis(Experts)
    pos = axis_name(Pos)
    scores = jax.nn.sigmoid(permute(router_logits, (..., pos, E.name)).array.astype(jnp.float32))
    share = scores / jnp.sum(scores, axis=-1, keepdims=True)
    ids = permute(expert_ids, (..., pos, TOP_EXPERTS)).array
    k = ids.shape[-1]
    chosen = jnp.sum(jax.nn.one_hot(ids, E.size, dtype=jnp.float32), axis=(-3, -2))  # per sequence
    tokens = ids.shape[-2]
    fraction = chosen * E.size / (k * tokens)
    return jnp.mean(jnp.sum(fraction * jnp.mean(share, axis=-2), axis=-1))


def balance_bias_update(correction_bias: NamedArray, load: NamedArray, rate: float) -> NamedArray:
    """DeepSeek-V3's aux-loss-free balancing step, outside the gradient: each expert's correction bias moves by
    `rate` up when its load is under the mean load (over the `experts` axis), down when over (unchanged when
    equal). `load` has the bias's axes (e.g. (experts,), or (layers, experts) for a stack of layers)."""
    names = correction_bias.axis_names
    load = permute(load.astype(jnp.float32), names)
    mean = jnp.mean(load.array, axis=names.index(EXPERTS) if EXPERTS in names else -1, keepdims=True)
    step = rate * jnp.sign(mean - load.array)
    return NamedArray((correction_bias.array + step).astype(correction_bias.dtype), correction_bias.axes)


class GroupLimitedMoE(eqx.Module):
    """DeepSeek-V3's MoE block: group_limited_routing over routed GatedExperts, plus shared experts that every
    token goes through (a gated MLP whose width is n_shared times an expert's).

    Layouts: `router.weight` (experts, embed), `correction_bias` (experts) (chooses experts only; it gets no
    gradient: an outside rule moves it, see DeepSeek-V3's aux-loss-free balancing), the experts as GatedExperts,
    `shared` a GatedMLP (its hidden axis `mlp`) or None. Calling it on x (..., position, embed) gives (output,
    aux): aux maps "router_aux_loss" to this call's sequence_balance_loss and ROUTER_LOAD to its expert_load.
    """

    router: Linear
    correction_bias: NamedArray
    experts: GatedExperts
    shared: GatedMLP | None
    num_experts_per_token: int = eqx.field(static=True)
    num_groups: int = eqx.field(static=True, default=1)
    top_groups: int = eqx.field(static=True, default=1)
    normalize_weights: bool = eqx.field(static=True, default=True)
    scaling_factor: float = eqx.field(static=True, default=1.0)
    block_size: int = eqx.field(static=True, default=DEFAULT_BLOCK_SIZE)

    @staticmethod
    def init(
        Embed: Axis,
        Experts: Axis,
        Mlp: Axis,
        num_experts_per_token: int,
        *,
        key: jax.Array,
        num_shared: int = 1,
        num_groups: int = 1,
        top_groups: int = 1,
        normalize_weights: bool = True,
        scaling_factor: float = 1.0,
        activation: str = "silu",
        init_scale: float = 0.02,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: DTypeLike = jnp.float32,
    ) -> GroupLimitedMoE:
        """Router and experts ~ Normal(0, init_scale), the correction bias zero; `num_shared` (>= 0) shared
        experts of Mlp's width each, fused into one gated MLP."""
        if not isinstance(num_shared, int) or num_shared < 0:
            raise ValueError(f"GroupLimitedMoE: num_shared must be an int >= 0, got {num_shared!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"GroupLimitedMoE: block_size must be a positive int, got {block_size!r}")
        # The same checks routing makes, before any weight is drawn.
        group_limited_routing(
            NamedArray(jnp.zeros((Experts.size,)), (Experts,)), Experts, num_experts_per_token,
            num_groups=num_groups, top_groups=top_groups,
        )  # fmt: skip
        k_router, k_experts, k_shared = jax.random.split(key, 3)
        router = Linear.init(
            Embed, Experts, key=k_router, use_bias=False, init_scale=init_scale, scale_by_fan_in=False, dtype=dtype
        )
        experts = GatedExperts.init(
            Experts, Embed, Mlp, key=k_experts, activation=activation, init_scale=init_scale, dtype=dtype
        )
        shared = None
        if num_shared:
            shared = GatedMLP.init(
                Embed, Axis(Mlp.name, Mlp.size * num_shared), Embed, key=k_shared, activation=activation,
                init_scale=init_scale, dtype=dtype,
            )  # fmt: skip
        bias = NamedArray(jnp.zeros((Experts.size,), jnp.float32), (Experts,))
        return GroupLimitedMoE(
            router, bias, experts, shared, num_experts_per_token, num_groups, top_groups, normalize_weights,
            float(scaling_factor), block_size,
        )  # fmt: skip

    def __call__(self, x: NamedArray) -> tuple[NamedArray, dict[str, jax.Array]]:
        """The routed experts' weighted output plus the shared experts' for every token of x, and this call's aux."""
        Embed = self.router.In[0]
        Experts = self.router.Out[0]
        require_axes(x, (Embed, POSITION), "GroupLimitedMoE")
        # The router in float32 whatever the compute dtype, as DeepSeek-V3 keeps it.
        weight = self.router.weight.astype(jnp.float32)
        logits = Linear(weight, None, self.router.In, self.router.Out)(x.astype(jnp.float32))
        weights, ids = group_limited_routing(
            logits, Experts, self.num_experts_per_token, correction_bias=self.correction_bias,
            num_groups=self.num_groups, top_groups=self.top_groups, normalize=self.normalize_weights,
            scaling_factor=self.scaling_factor,
        )  # fmt: skip
        out = self.experts(x, ids, weights, Embed=Embed, block_size=self.block_size)
        if self.shared is not None:
            out = out + self.shared(x)
        aux = {
            "router_aux_loss": sequence_balance_loss(logits, ids, Experts),
            ROUTER_LOAD: expert_load(ids, Experts).array,
        }
        return out, aux


__all__ = [
    "EXPERTS",
    "GroupLimitedMoE",
    "balance_bias_update",
    "expert_load",
    "group_limited_routing",
    "sequence_balance_loss",
]
