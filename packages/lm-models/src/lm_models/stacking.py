"""The layer stack of a model: scanned (nt.Stacked) or unrolled (nt.BlockSeq), and conversion between them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, cast

import equinox as eqx
import jax

import named_tensors as nt

from .config import checkpoint_policy, resolve_scan_unroll

ModelT = TypeVar("ModelT", bound=eqx.Module)
# A model of any family: its `config`, `blocks` and `transformer` fields are found by name below, so the code
# reads them through cast(Any, model).


def build_blocks(config: Any, make_block: Callable[[jax.Array], Any], *, key: jax.Array) -> Any:
    """config.num_layers blocks, as nt.Stacked when config.scan_layers else nt.BlockSeq (same weights)."""
    policy = checkpoint_policy(config.gradient_checkpointing)
    if config.scan_layers:
        return nt.Stacked.init(
            config.Layers, make_block, key=key, gradient_checkpointing=policy, unroll=resolve_scan_unroll(config)
        )
    return nt.BlockSeq.init(config.Layers, make_block, key=key, gradient_checkpointing=policy)


def unstack_layers(model: ModelT) -> ModelT:
    """The model with its scanned layers (nt.Stacked) turned into per-layer modules (nt.BlockSeq)."""
    return _convert(model, lambda blocks: blocks.unstack() if isinstance(blocks, nt.Stacked) else blocks)


def stack_layers(model: ModelT) -> ModelT:
    """The model with per-layer modules (nt.BlockSeq) turned into one scanned nt.Stacked (config.scan_unroll
    layers per scan step)."""
    unroll = resolve_scan_unroll(cast(Any, model).config)  # Backpack's config is also its inner transformer's
    return _convert(
        model, lambda blocks: blocks.stack().with_unroll(unroll) if isinstance(blocks, nt.BlockSeq) else blocks
    )


def _convert(model: ModelT, fn: Callable[[Any], Any], policy: bool | str | None = None) -> ModelT:
    fields = {f.name for f in dataclasses.fields(model)}
    found = cast(Any, model)
    if "blocks" in fields:
        blocks = fn(found.blocks)
        # Keep the config truthful about the layout and the policy that the model holds.
        changes: dict[str, Any] = {"scan_layers": isinstance(blocks, nt.Stacked)}
        if policy is not None:
            changes["gradient_checkpointing"] = policy
        return dataclasses.replace(model, blocks=blocks, config=dataclasses.replace(found.config, **changes))
    if "transformer" in fields:  # a model wrapped around another one's layer stack (Backpack)
        transformer = _convert(found.transformer, fn, policy)
        changes = {"scan_layers": transformer.config.scan_layers}
        if policy is not None:
            changes["gradient_checkpointing"] = policy
        config = dataclasses.replace(found.config, **changes)
        return dataclasses.replace(model, transformer=transformer, config=config)
    raise TypeError(f"{type(model).__name__} has no `blocks` layer stack to convert")


def with_gradient_checkpointing(model: ModelT, policy: bool | str, platform: str | None = None) -> ModelT:
    """The same model (same weights, same layout) with another gradient checkpointing policy.

    `scan_unroll: auto` depends on the policy, so a scan's unrolling follows it, as it would on `platform`
    (default: the devices present)."""
    name = checkpoint_policy(policy)
    config = cast(Any, model).config
    unroll = resolve_scan_unroll(dataclasses.replace(config, gradient_checkpointing=policy), platform)

    def change(blocks: Any) -> Any:
        blocks = dataclasses.replace(blocks, gradient_checkpointing=name)
        return blocks.with_unroll(unroll) if isinstance(blocks, nt.Stacked) else blocks

    return _convert(model, change, policy=policy)
