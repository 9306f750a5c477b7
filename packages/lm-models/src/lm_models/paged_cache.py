"""PagedKVCache: keys and values in one pool of fixed-size pages, read per sequence through its page table."""

from __future__ import annotations

import dataclasses
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
    step's page tables (..., page_index), the pool slot of each new token (..., position), and each new token's
    place in its sequence (..., position; past the end for padding).

    Logical page i of a sequence holds its positions i * page_size ... (i + 1) * page_size - 1, so reading a
    sequence through its page table gives its keys in position order: slot j is position j. A stacked cache
    (nt.Stacked's per-layer input) leads every field with `layers`.

    A layer does not write its new keys and values into the pool: it reads them in place of what the pool holds at
    their positions, and hands them back without the pool (`handed_back`); paged_forward writes every layer's into
    the pool in one scatter. A pool that went through the layer stack's outputs would be copied whole per layer
    and token.
    """

    key: NamedArray | None  # None in what a layer hands back
    value: NamedArray | None
    page_table: NamedArray
    slots: NamedArray
    places: NamedArray
    new_key: NamedArray | None = None  # this step's keys (..., key_position, kv_heads, head_size), once written
    new_value: NamedArray | None = None

    @staticmethod
    def zeros(Page: Axis, PagePos: Axis, KVHeads: Axis, HeadSize: Axis, *, dtype=jnp.float32) -> PagedKVCache:
        """An empty pool for one layer, with no sequence attached (page tables come with each step)."""
        axes = (Page, PagePos, KVHeads, HeadSize)
        empty = nt.zeros((Axis(PAGE_INDEX, 1),), jnp.int32)
        nowhere = nt.zeros((Axis(POSITION, 1),), jnp.int32)
        return PagedKVCache(nt.zeros(axes, dtype), nt.zeros(axes, dtype), empty, nowhere, nowhere)

    @property
    def page_size(self) -> int:
        return self.pool_key.axis_size(PAGE_POSITION)

    @property
    def pool_key(self) -> NamedArray:
        if self.key is None:
            raise ValueError("this paged cache was handed back by a layer: it holds that layer's new keys, no pool")
        return self.key

    @property
    def pool_value(self) -> NamedArray:
        if self.value is None:
            raise ValueError("this paged cache was handed back by a layer: it holds that layer's new values, no pool")
        return self.value

    def attach(self, page_table: NamedArray, slots: NamedArray, places: NamedArray) -> PagedKVCache:
        """The same pool for a step over these page tables, whose tokens go to pool `slots` and sit at `places`
        of their sequences (past the end of the page table's positions: padding, never read)."""
        i32 = jnp.int32
        return PagedKVCache(self.key, self.value, page_table.astype(i32), slots.astype(i32), places.astype(i32))

    def write(self, key: NamedArray, value: NamedArray, offset=None) -> PagedKVCache:
        """The cache with the step's new keys/values (axes ..., key_position, kv_heads, head_size), which read()
        gives at their places; `offset` is not used: each token's place already says where it goes."""
        del offset
        return dataclasses.replace(self, new_key=key, new_value=value)

    def read(self) -> tuple[NamedArray, NamedArray, NamedArray]:
        """Each sequence's keys and values in position order (..., key_position, kv_heads, head_size), gathered
        through its page table with the step's new ones in place, and the position of each key slot."""
        key = self._view(self.pool_key, self.new_key)
        value = self._view(self.pool_value, self.new_value)
        return key, value, nt.arange(key.resolve_axis(KEY_POSITION), dtype=jnp.int32)

    def handed_back(self) -> PagedKVCache:
        """What a layer gives back: its new keys and values, without the pool (see the class)."""
        return dataclasses.replace(self, key=None, value=None)

    def _view(self, pool: NamedArray, new: NamedArray | None) -> NamedArray:
        pages = nt.take(pool, PAGE, self.page_table)
        view = nt.flatten_axes(pages, (PAGE_INDEX, PAGE_POSITION), KEY_POSITION)
        if new is None:
            return view
        view = nt.permute(view, (..., KEY_POSITION, *pool.axes[2:]))
        batch = view.axes[: view.ndim - 3]
        places = nt.permute(self.places, (*batch, POSITION)).array
        updates = nt.permute(new.astype(pool.dtype), (*batch, KEY_POSITION, *pool.axes[2:])).array
        n = view.array.shape[len(batch)]
        # For each key slot, the new token placed there (padding sits past the end: none); a select, not a scatter,
        # so that it fuses with the gather.
        hits = places[..., :, None] == jnp.arange(n).reshape((1,) * places.ndim + (n,))  # (..., position, key_position)
        source = jnp.argmax(hits, axis=-2)  # (..., key_position)
        placed = jnp.any(hits, axis=-2)
        picked = jnp.take_along_axis(updates, source[..., None, None], axis=len(batch))
        return NamedArray(jnp.where(placed[..., None, None], picked, view.array), view.axes)


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
    pool_key, pool_value = cache.pool_key, cache.pool_value
    Layers = pool_key.resolve_axis("layers")
    page_size = pool_key.axis_size(PAGE_POSITION)
    slots = token_slots(page_table, positions, valid, page_size)
    # Padding is placed past the end of the sequences' positions, where reading drops it.
    places = nt.where(valid, positions, page_table.axis_size(PAGE_INDEX) * page_size)
    # Every layer reads the same page tables: nt.Stacked slices per-layer inputs along `layers`.
    step = cache.attach(*(nt.broadcast_to(a, (Layers, *a.axes)) for a in (page_table, slots, places)))
    hidden, new = model.activations(input_ids, None, key=None, cache=step, cache_offset=0, positions=positions)
    assert new.new_key is not None and new.new_value is not None  # every layer wrote its keys and values
    key = _scatter(pool_key, new.new_key, slots)
    value = _scatter(pool_value, new.new_value, slots)
    return model.logits_from_activations(hidden), dataclasses.replace(cache, key=key, value=value)


def _scatter(pool: NamedArray, new: NamedArray, slots: NamedArray) -> NamedArray:
    """The stacked pool (layers, page, page_position, ...) with every layer's new keys or values (layers, ...,
    key_position, ...) stored at the tokens' `slots` (..., position)."""
    pool = nt.permute(pool, ("layers", PAGE, PAGE_POSITION, ...))
    flat = nt.flatten_axes(pool, (PAGE, PAGE_POSITION), "slot")
    rest = flat.axes[2:]
    slots = slots.rename({POSITION: KEY_POSITION})
    new = nt.permute(new.astype(pool.dtype), ("layers", *slots.axes, *rest))
    updates = new.array.reshape((new.array.shape[0], -1, *(a.size for a in rest)))
    updated = flat.array.at[:, slots.array.reshape(-1)].set(updates)
    return nt.unflatten_axis(NamedArray(updated, flat.axes), "slot", pool.axes[1:3])
