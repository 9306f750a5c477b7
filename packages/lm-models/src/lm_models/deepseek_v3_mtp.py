"""DeepSeek-V3's multi-token prediction (MTP): extra depths that each predict one token further ahead, trained
beside the main model through one more block and the shared embedding and head."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import Axis, NamedArray
from named_tensors.nn import Linear, RMSNorm

from .deepseek_v3 import MTP_INPUT, DeepseekV3Config
from .model import POSITION, given_positions

MTP_LOSS = "mtp_loss"


class MtpDepth(eqx.Module):
    """One MTP depth: RMSNorms of the shifted tokens' embedding (enorm) and of the previous depth's hidden state
    (hnorm), a projection of their concatenation (eh_proj: (embed, mtp_input) with mtp_input = [enorm; hnorm], as
    DeepSeek's eh_proj.weight), one DeepSeek-V3 block, and the norm before the shared head."""

    enorm: RMSNorm
    hnorm: RMSNorm
    eh_proj: Linear
    block: Any  # a DeepseekV3Block, of the kind of the model's last layer
    norm: RMSNorm

    @staticmethod
    def init(config: DeepseekV3Config, block: Any, *, key: jax.Array) -> MtpDepth:
        """Fresh norms (at one) and projection (~ Normal(0, initializer_range)) around `block`."""
        c = config
        proj = Linear.init(
            Axis(MTP_INPUT, 2 * c.hidden_dim), c.Embed, key=key, use_bias=False, init_scale=c.initializer_range,
            scale_by_fan_in=False,
        )  # fmt: skip

        def norm() -> RMSNorm:
            return RMSNorm.init(c.Embed, eps=c.layer_norm_epsilon)

        return MtpDepth(norm(), norm(), proj, block, norm())

    def __call__(
        self, hidden: NamedArray, embedded: NamedArray, attn_mask: Any, positions: NamedArray, *, key, inference
    ) -> NamedArray:
        """This depth's hidden states (before its head norm), from the previous depth's and the embeddings."""
        parts = [self.enorm(embedded), self.hnorm(hidden)]
        joined = nt.concatenate(MTP_INPUT, [p.rename({"embed": MTP_INPUT}) for p in parts])
        x, _ = self.block(self.eh_proj(joined), attn_mask, positions, key=key, inference=inference, cache_offset=0)
        return x


def mtp_loss(model: Any, hidden: NamedArray, input_ids: NamedArray, attn_mask: Any, key: jax.Array | None) -> jax.Array:
    """The mean over the MTP depths k = 1..D of the cross-entropy of predicting token t + k + 1 at each position t
    (positions whose target is past the end are not scored), float32.

    Depth k takes depth k - 1's hidden states (depth 0: the main model's final ones) and the embeddings of the
    tokens k ahead; its logits come from the model's shared head after the depth's own norm.
    """
    Pos = input_ids.resolve_axis(POSITION)
    positions = given_positions(input_ids, None, 0)
    losses = []
    for k, depth in enumerate(model.mtp, start=1):
        ahead = nt.roll(input_ids, -k, POSITION)
        targets = nt.roll(input_ids, -(k + 1), POSITION)
        scored = nt.arange(Pos, dtype=jnp.int32) < Pos.size - k - 1
        depth_key = None if key is None else jax.random.fold_in(key, k)
        embedded = model.embed_tokens.embed(ahead)
        hidden = depth(hidden, embedded, attn_mask, positions, key=depth_key, inference=model.inference)
        logits = model.logits_from_activations(depth.norm(hidden))
        ce = nt.nn.cross_entropy_loss(logits, model.Vocab, targets, mask=scored, reduction="mean")
        losses.append(ce.array.astype(jnp.float32))
    return sum(losses[1:], losses[0]) / len(losses)
