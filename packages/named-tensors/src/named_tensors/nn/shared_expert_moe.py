"""Llama 4's mixture of experts: the k largest router logits pick the experts, their sigmoids scale the token
that each chosen expert receives (not the expert's output), and a shared gated MLP sees every token.

The routed experts run through GatedExperts' dropless dispatch (nn.moe), so expert parallelism applies as there:
each (token, choice) pair is one row, routed to its one expert with weight one.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from .. import _ops as ops
from .._core import Axis, AxisSelector, NamedArray, axis_name, permute
from .._indexing import top_k
from .linear import Linear
from .mlp import GatedMLP
from .moe import DEFAULT_BLOCK_SIZE, ROUTER_LOAD, TOP_EXPERTS, GatedExperts, expert_load, load_balancing_loss

# The k choices of a token, each a row of its own on the way to the experts.
_CHOICE = "expert_choice"


def sigmoid_top_k_routing(
    router_logits: NamedArray, Experts: AxisSelector, k: int, *, TopExperts: AxisSelector = TOP_EXPERTS
) -> tuple[NamedArray, NamedArray]:
    """(weights, expert ids): the k largest logits over Experts and their sigmoids (float32), both with Experts
    replaced by TopExperts (size k); ids are int32."""
    top, ids = top_k(router_logits, Experts, k, new_axis=TopExperts)
    weights = NamedArray(jax.nn.sigmoid(top.array.astype(jnp.float32)), top.axes)
    return weights, ids.astype(jnp.int32)


class SharedExpertMoE(eqx.Module):
    """A router (embed -> experts, no bias) choosing k of E gated experts per token by sigmoid_top_k_routing;
    expert e gets weight_e * x and its outputs are summed, plus a shared gated MLP of x.

    Layouts: `router.weight` (experts, embed), the experts as GatedExperts, `shared` a GatedMLP (hidden axis
    `mlp`). Calling it gives (output, aux): aux maps "router_aux_loss" to this call's load_balancing_loss (the
    Switch loss over the softmax of the logits) and ROUTER_LOAD to its expert_load.
    """

    router: Linear
    experts: GatedExperts
    shared: GatedMLP
    num_experts_per_token: int = eqx.field(static=True)
    block_size: int = eqx.field(static=True, default=DEFAULT_BLOCK_SIZE)

    @staticmethod
    def init(
        Embed: Axis,
        Experts: Axis,
        Mlp: Axis,
        num_experts_per_token: int,
        *,
        key: jax.Array,
        SharedMlp: Axis | None = None,
        activation: str = "silu",
        init_scale: float = 0.02,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: DTypeLike = jnp.float32,
    ) -> SharedExpertMoE:
        """Router, experts (hidden axis Mlp) and the shared MLP (hidden axis SharedMlp, default Mlp), all weights
        ~ Normal(0, init_scale)."""
        if not 1 <= num_experts_per_token <= Experts.size:
            raise ValueError(
                f"SharedExpertMoE: num_experts_per_token={num_experts_per_token} must be between 1 and the number "
                f"of experts {Experts.size}"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"SharedExpertMoE: block_size must be a positive int, got {block_size!r}")
        k_router, k_experts, k_shared = jax.random.split(key, 3)
        router = Linear.init(
            Embed, Experts, key=k_router, use_bias=False, init_scale=init_scale, scale_by_fan_in=False, dtype=dtype
        )
        experts = GatedExperts.init(
            Experts, Embed, Mlp, key=k_experts, activation=activation, init_scale=init_scale, dtype=dtype
        )
        shared = GatedMLP.init(
            Embed, SharedMlp or Mlp, Embed, key=k_shared, activation=activation, init_scale=init_scale, dtype=dtype
        )
        return SharedExpertMoE(router, experts, shared, num_experts_per_token, block_size)

    def __call__(self, x: NamedArray) -> tuple[NamedArray, dict[str, jax.Array]]:
        """The chosen experts' outputs on their scaled inputs, plus the shared MLP's, for every token of x; aux."""
        Embed = self.router.In[0]
        Experts = self.router.Out[0]
        E = axis_name(Embed)
        logits = self.router(x)
        weights, ids = sigmoid_top_k_routing(logits, Experts, self.num_experts_per_token)
        # One row per (token, choice): the token scaled by its weight, sent to one expert with weight one.
        Choice = Axis(_CHOICE, self.num_experts_per_token)
        scaled = x * weights.astype(x.dtype).rename({TOP_EXPERTS: _CHOICE})
        scaled = permute(scaled, (..., E))
        token_axes = scaled.axes[:-1]
        names = [a.name for a in token_axes]
        One = Axis(TOP_EXPERTS, 1)
        row_ids = permute(ids.rename({TOP_EXPERTS: _CHOICE}), names).array[..., None]
        row_ids = NamedArray(row_ids, (*token_axes, One))
        ones = NamedArray(jnp.ones(row_ids.array.shape, jnp.float32), row_ids.axes)
        routed = self.experts(scaled, row_ids, ones, Embed=Embed, block_size=self.block_size)
        out = ops.sum(routed, Choice) + self.shared(x)
        aux = {
            "router_aux_loss": load_balancing_loss(logits, ids, Experts),
            ROUTER_LOAD: expert_load(ids, Experts).array,
        }
        return permute(out, x.axis_names), aux


__all__ = ["SharedExpertMoE", "sigmoid_top_k_routing"]
