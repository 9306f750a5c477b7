"""The examples of each step: a pure function of (cache, seq_len, seed, step, batch size), whatever the readers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import shard_cache
from shard_cache import TokenWindows

from lm_train.data import DATA_TIMEOUT_S
from lm_train.data.caches import PreparedData
from lm_train.data.sft_data import data_summary
from lm_train.errors import DataError


@dataclass(frozen=True)
class ProcessSlice:
    """Which share of each global batch this process reads: the index-th of `count` equal, contiguous slices."""

    index: int = 0
    count: int = 1

    def of(self, global_positions: np.ndarray) -> np.ndarray:
        """This process's part of a global batch's example positions."""
        return shard_cache.process_slice(global_positions, self.index, self.count)


def _token_windows(reader: shard_cache.CacheReader, seq_len: int) -> TokenWindows:
    return reader.token_windows(seq_len)


class TrainBatches:
    """This process's rows of each training step's global batch, in the order `data.shuffle` says.

    `examples(reader, seq_len)` makes the cache's examples (default: token windows; lm_train.data.sft_data
    gives packed or padded whole documents, whose batches are dicts of fields).
    """

    def __init__(
        self,
        data: PreparedData,
        seq_len: int,
        batch_size: int,
        seed: int,
        shuffle: bool | int,
        part: ProcessSlice,
        examples: Callable[[shard_cache.CacheReader, int], Any] = _token_windows,
    ):
        self.batch_size = batch_size
        self.part = part
        reader = shard_cache.open_cache(data.train_cache, timeout=DATA_TIMEOUT_S)
        self.windows: Any = examples(reader, seq_len)
        if shuffle is True:
            self._order = None  # the full permutation needs the final size; made on first use
        elif shuffle is False:
            self._order = self.windows
        else:
            self._order = self.windows.era_shuffled(seed, int(shuffle))
        self.seed = seed
        self.cache_dir = data.train_cache

    def _source(self):
        if self._order is None:
            self._order = self.windows.shuffled(self.seed, timeout=DATA_TIMEOUT_S)
        return self._order

    def indices(self, step: int) -> np.ndarray:
        """Global example positions of a step (this process's slice only)."""
        start = step * self.batch_size
        return self.part.of(np.arange(start, start + self.batch_size, dtype=np.int64))

    def summary(self) -> Any:
        """What the training data held and left out (a sft_data.DataSummary), or None."""
        return data_summary(self.windows, self.cache_dir, finished=self.windows.reader.finished)

    def batch(self, step: int) -> np.ndarray | dict[str, np.ndarray]:
        """This process's examples of `step`: int32 [batch_size / process count, seq_len] (or a dict of such)."""
        positions = self.indices(step)
        source = self._source()
        final = self.windows.final_num_examples()
        if final:  # epochs wrap around; positions inside the first epoch are unchanged
            positions = positions % final
        try:
            return source.get_batch(positions, timeout=DATA_TIMEOUT_S)
        except IndexError:  # the build finished with fewer examples than this step asked for
            final = self.windows.wait_for_final(timeout=DATA_TIMEOUT_S)
            if final == 0:
                raise DataError(_no_example_message(self.cache_dir, self.windows.seq_len)) from None
            return source.get_batch(positions % final, timeout=DATA_TIMEOUT_S)


def _no_example_message(cache_dir: str, seq_len: int) -> str:
    """Why training has no example, naming the inputs that gave no document (from the cache's ledger)."""
    summary = shard_cache.inspect_cache(cache_dir)
    empty = summary.get("empty_inputs") or []
    if empty and summary.get("docs", 0) == 0:
        named = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        return (
            f"The training data has no document: every input gave none ({named}; empty, or every document "
            "skipped). Check data.train_urls."
        )
    note = f" These inputs gave no document: {', '.join(empty[:5])}." if empty else ""
    return (
        f"The training data has no example of {seq_len} tokens: its {summary.get('docs', 0)} documents hold "
        f"{summary.get('tokens', 0)} tokens in all (cache {cache_dir}).{note} Give more text (data.train_urls) or a "
        "shorter model.seq_len."
    )


def validation_batches(
    data: PreparedData,
    seq_len: int,
    batch_size: int,
    max_batches: int | None,
    part: ProcessSlice,
    examples: Callable[[shard_cache.CacheReader, int], Any] = _token_windows,
) -> Iterator[np.ndarray | dict[str, np.ndarray]]:
    """One unshuffled pass over the validation cache, in full global batches (this process's rows of each)."""
    if data.validation_cache is None:
        return iter(())
    reader = shard_cache.open_cache(data.validation_cache, timeout=DATA_TIMEOUT_S)
    batches = examples(reader, seq_len).iter_batches(
        batch_size, process_index=part.index, process_count=part.count, timeout=DATA_TIMEOUT_S
    )
    for i, batch in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            return
        yield batch
