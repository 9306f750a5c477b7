"""The arrays of one engine step, built on the host from the sequences in it (growing their pages as needed)."""

from __future__ import annotations

import numpy as np

from lm_models.paged_cache import NULL_PAGE

from .pages import PagePool
from .requests import Sequence
from .step import StepRows


def grow(seq: Sequence, last_position: int, pool: PagePool) -> None:
    """Give a sequence pages (from its reservation) up to the one that holds last_position."""
    while len(seq.pages) * pool.page_size <= last_position:
        seq.pages.append(pool.allocate())
        seq.reserved -= 1


_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "presence", "frequency", "seed", "choice", "index")


class _SamplingColumns:
    """Each row's sampling settings, one numpy column per setting; padding rows keep the defaults."""

    def __init__(self, rows: int) -> None:
        self.temperature = np.zeros((rows,), np.float32)
        self.top_k = np.zeros((rows,), np.int32)
        self.top_p = np.ones((rows,), np.float32)
        self.presence = np.zeros((rows,), np.float32)
        self.frequency = np.zeros((rows,), np.float32)
        self.seed = np.zeros((rows,), np.uint32)
        self.choice = np.zeros((rows,), np.int32)
        self.index = np.zeros((rows,), np.int32)

    def fill(self, r: int, seq: Sequence) -> None:
        """Row r samples as seq's request asks, at the index of its next generated token."""
        p = seq.request.params
        self.temperature[r], self.top_k[r], self.top_p[r] = p.temperature, p.top_k, p.top_p
        self.presence[r], self.frequency[r] = p.presence_penalty, p.frequency_penalty
        self.seed[r], self.choice[r], self.index[r] = seq.request.seed, seq.choice, len(seq.generated)

    def arrays(self) -> tuple:
        """The columns, in _SAMPLING_FIELDS' order."""
        return tuple(getattr(self, name) for name in _SAMPLING_FIELDS)


def build_rows(
    seqs: list[Sequence | None],
    chunk: int,
    starts: list[int],
    sizes: list[int],
    pool: PagePool,
    pages_per_seq: int,
    padding_slot: int,
) -> StepRows:
    """Row r feeds tokens starts[r] ... starts[r] + sizes[r] - 1 of seqs[r] (None: a padding row)."""
    R = len(seqs)
    ids = np.zeros((R, chunk), np.int32)
    positions = np.zeros((R, chunk), np.int32)
    valid = np.zeros((R, chunk), bool)
    targets = np.zeros((R, chunk), np.int32)
    last = np.zeros((R,), np.int32)
    slot = np.full((R,), padding_slot, np.int32)
    reset = np.zeros((R,), bool)
    emit = np.zeros((R,), bool)
    sampling = _SamplingColumns(R)
    tables = np.full((R, pages_per_seq), NULL_PAGE, np.int32)
    for r, seq in enumerate(seqs):
        if seq is None:
            continue
        start, size = starts[r], sizes[r]
        tokens = seq.tokens
        grow(seq, start + size - 1, pool)
        tables[r, : len(seq.pages)] = seq.pages
        ids[r, :size] = tokens[start : start + size]
        positions[r, :size] = np.arange(start, start + size)
        valid[r, :size] = True
        following = tokens[start + 1 : start + size + 1]
        targets[r, : len(following)] = following
        last[r] = size - 1
        slot[r] = seq.slot
        reset[r] = start == seq.first_computed  # a new sequence: its penalty counts start from zero
        emit[r] = start + size >= len(seq.prompt)  # the token sampled is generated, not a prompt token's
        sampling.fill(r, seq)
    params = [seq.request.params for seq in seqs if seq is not None]
    want_top = np.asarray(any(p.logprobs for p in params))
    want_prompt = np.asarray(any(p.prompt_logprobs for p in params))
    # Host arrays, handed to the compiled step as they are: jax.device_put of a tuple costs a transfer per array.
    return StepRows(
        ids=ids, positions=positions, valid=valid, page_table=tables, targets=targets, last=last, slot=slot,
        reset=reset, emit=emit, **dict(zip(_SAMPLING_FIELDS, sampling.arrays(), strict=True)), want_top=want_top,
        want_prompt=want_prompt,
    )  # fmt: skip
