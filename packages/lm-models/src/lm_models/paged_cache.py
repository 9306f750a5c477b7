"""PagedKVCache: keys and values in one pool of fixed-size pages, read per sequence through its page table."""

from __future__ import annotations

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import Axis, NamedArray

from .kv_cache import KEY_POSITION

PAGE = "page"
PAGE_POSITION = "page_position"
PAGE_INDEX = "page_index"
POSITION = "position"
# Page 0 is never given to a sequence: the unused entries of a page table point at it, and the tokens of padded
# rows are written into it, so that neither ever touches a live page.
NULL_PAGE = 0


class PagedKVCache(eqx.Module):
    """One layer's pool of pages (page, page_position, kv_heads, head_size), shared by every sequence, plus this
    step's page tables (..., page_index) and the slot each new token is written to (..., position).

    Logical page i of a sequence holds its positions i * page_size ... (i + 1) * page_size - 1, so reading a
    sequence through its page table gives its keys in position order: slot j is position j. A stacked cache
    (nt.Stacked's per-layer input) leads every field with `layers`.
    """

    key: NamedArray
    value: NamedArray
    page_table: NamedArray
    slots: NamedArray

    @staticmethod
    def zeros(Page: Axis, PagePos: Axis, KVHeads: Axis, HeadSize: Axis, *, dtype=jnp.float32) -> PagedKVCache:
        """An empty pool for one layer, with no sequence attached (page tables come with each step)."""
        axes = (Page, PagePos, KVHeads, HeadSize)
        empty = nt.zeros((Axis(PAGE_INDEX, 1),), jnp.int32)
        return PagedKVCache(
            nt.zeros(axes, dtype), nt.zeros(axes, dtype), empty, nt.zeros((Axis(POSITION, 1),), jnp.int32)
        )

    @property
    def page_size(self) -> int:
        return self.key.axis_size(PAGE_POSITION)

    def attach(self, page_table: NamedArray, slots: NamedArray) -> PagedKVCache:
        """The same pool for a step over these page tables, writing the step's tokens to `slots`."""
        return PagedKVCache(self.key, self.value, page_table.astype(jnp.int32), slots.astype(jnp.int32))

    def write(self, key: NamedArray, value: NamedArray, offset=None) -> PagedKVCache:
        """The pool with the new keys/values (axes ..., key_position, kv_heads, head_size) stored at the step's
        slots; `offset` is not used: each token's slot already says where it goes."""
        del offset
        return PagedKVCache(self._scatter(self.key, key), self._scatter(self.value, value), self.page_table, self.slots)

    def _scatter(self, pool: NamedArray, new: NamedArray) -> NamedArray:
        # named-tensors' permute takes `...` (its docstring says so); its annotation does not yet.
        pool = nt.permute(pool, (PAGE, PAGE_POSITION, ...))
        flat = nt.flatten_axes(pool, (PAGE, PAGE_POSITION), "slot")
        rest = flat.axes[1:]
        slots = self.slots.rename({POSITION: KEY_POSITION})
        new = nt.permute(new.astype(pool.dtype), (*slots.axes, *rest))
        updated = flat.array.at[slots.array.reshape(-1)].set(new.array.reshape((-1, *(a.size for a in rest))))
        return nt.unflatten_axis(NamedArray(updated, flat.axes), "slot", pool.axes[:2])

    def read(self) -> tuple[NamedArray, NamedArray, NamedArray]:
        """Each sequence's keys and values in position order (..., key_position, kv_heads, head_size), gathered
        through its page table, and the position of each key slot."""

        def gather(pool: NamedArray) -> NamedArray:
            pages = nt.take(pool, PAGE, self.page_table)
            return nt.flatten_axes(pages, (PAGE_INDEX, PAGE_POSITION), KEY_POSITION)

        key, value = gather(self.key), gather(self.value)
        return key, value, nt.arange(key.resolve_axis(KEY_POSITION), dtype=jnp.int32)


def token_slots(page_table: NamedArray, positions: NamedArray, valid: NamedArray, page_size: int) -> NamedArray:
    """The pool slot (page * page_size + offset) of each token at `positions` of its sequence (axes ..., position);
    tokens that are not `valid` (padding) go to the null page."""
    page = _page_of(page_table, positions // page_size)
    slot = page * page_size + positions % page_size
    return nt.where(valid, slot, NULL_PAGE * page_size + positions % page_size)


def _page_of(page_table: NamedArray, logical: NamedArray) -> NamedArray:
    """page_table[..., logical[..., position]]: the physical page of each token's logical page."""
    table = nt.permute(page_table, (..., PAGE_INDEX))
    batch = [a for a in table.axes if a.name != PAGE_INDEX]
    logical = nt.permute(logical, (*batch, POSITION))
    clipped = jnp.clip(logical.array, 0, table.axis_size(PAGE_INDEX) - 1)
    return NamedArray(jnp.take_along_axis(table.array, clipped, axis=-1), logical.axes)


def init_paged_cache(config, num_pages: int, page_size: int, dtype=jnp.float32) -> PagedKVCache:
    """An empty pool of num_pages pages of page_size positions for every layer of a model: fields lead with
    `layers` (config.Layers), as nt.Stacked's per-layer inputs do."""
    if num_pages < 2 or page_size < 1:
        raise ValueError(f"a paged cache needs at least 2 pages (page 0 is reserved) of >= 1 position, got "
                         f"num_pages={num_pages}, page_size={page_size}")  # fmt: skip
    one = PagedKVCache.zeros(
        Axis(PAGE, num_pages), Axis(PAGE_POSITION, page_size), config.KVHeads, config.HeadSize, dtype=dtype
    )
    return _stacked(config.Layers, one)


def _stacked(Layers: Axis, tree):
    return jax.tree.map(
        lambda x: nt.broadcast_to(x, (Layers, *x.axes)), tree, is_leaf=lambda x: isinstance(x, NamedArray)
    )


def supports_paging(model) -> bool:
    """Whether a model can decode through a paged cache: its activations() take each token's position, and its
    class does not opt out (`supports_paged_cache = False`: DeepSeek-V3, whose cache holds latents)."""
    if not getattr(type(model), "supports_paged_cache", True):
        return False
    return "positions" in inspect.signature(model.activations).parameters


def paged_forward(
    model, cache: PagedKVCache, input_ids: NamedArray, positions: NamedArray, valid: NamedArray, page_table: NamedArray
) -> tuple[NamedArray, PagedKVCache]:
    """Logits (..., position, vocab) of input_ids at `positions` of their sequences, whose earlier keys and values
    the pool holds at the pages `page_table` (..., page_index) names; and the pool with this step's tokens
    written. Tokens that are not `valid` (padding) are written to the null page and their logits mean nothing."""
    if not supports_paging(model):
        raise TypeError(f"{type(model).__name__} cannot decode through a paged cache: its activations() take no "
                        "per-token positions")  # fmt: skip
    Layers = cache.key.resolve_axis("layers")
    slots = token_slots(page_table, positions, valid, cache.key.axis_size(PAGE_POSITION))
    # Every layer reads the same page tables: nt.Stacked slices per-layer inputs along `layers`.
    step = cache.attach(
        nt.broadcast_to(page_table, (Layers, *page_table.axes)), nt.broadcast_to(slots, (Layers, *slots.axes))
    )
    hidden, new = model.activations(input_ids, None, key=None, cache=step, cache_offset=0, positions=positions)
    return model.logits_from_activations(hidden), PagedKVCache(new.key, new.value, cache.page_table, cache.slots)
