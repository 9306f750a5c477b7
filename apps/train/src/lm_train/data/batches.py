"""The examples of each step: shard-cache's mixture sampler over the sources' examples (a single source is a
mixture of one), a pure function of (caches, seq_len, seed, weight schedule, batch size or schedule) and the step.

The global sequence of (source, example) is the same for any number of processes, and a resumed run asks for the
same steps again. A single source's layout is the identity (position p is its example p), and its examples are
ordered with the run's seed itself, so its batches are those of the source read on its own; a mixture's sources
are shuffled apart, each with a seed derived from its name. The per-source accounting behind
`data/<name>/tokens_seen` is the sampler's closed form, computed on the host.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import shard_cache
from shard_cache import BatchSchedule, MixtureExamples, MixtureLayout

from lm_train.config.batch_sizes import padded
from lm_train.config.data_config import DataConfig
from lm_train.config.mixture_keys import SINGLE_SOURCE, data_schedule, source_key, source_shuffle
from lm_train.data import DATA_TIMEOUT_S
from lm_train.data.caches import PreparedData
from lm_train.data.sft_data import DataSummary, data_summary, token_windows
from lm_train.errors import DataError


@dataclass(frozen=True)
class ProcessSlice:
    """Which share of each global batch this process reads: the index-th of `count` equal, contiguous slices."""

    index: int = 0
    count: int = 1

    def of(self, global_positions: np.ndarray) -> np.ndarray:
        """This process's part of a global batch's example positions."""
        return shard_cache.process_slice(global_positions, self.index, self.count)


def source_seed(seed: int, name: str) -> int:
    """The shuffle seed of one source of a mixture: derived from the run's seed and the name, so sources are
    shuffled apart."""
    digest = hashlib.blake2b(f"lm-train-mixture-source:{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _FullShuffle:
    """`examples.shuffled(seed)`, made on first use: the full permutation needs the final size, which a source
    still being built learns only when its build ends, so asking for it up front would block the run's start."""

    def __init__(self, examples: Any, seed: int):
        self.base = examples
        self.seed = seed
        self._view = None
        self._lock = threading.Lock()

    def get_batch(self, indices: Any, timeout: float | None = None) -> Any:
        with self._lock:
            if self._view is None:
                self._view = self.base.shuffled(self.seed, timeout=DATA_TIMEOUT_S)
        return self._view.get_batch(indices, timeout)


def _ordered(examples: Any, shuffle: bool | int, seed: int) -> Any:
    if shuffle is True:
        return _FullShuffle(examples, seed)
    if shuffle is False:
        return examples
    return examples.era_shuffled(seed, int(shuffle))


class TrainBatches:
    """This process's rows of each training step, and the sources' host-side accounting.

    `views`: each trained source's examples (token windows, or packed or padded documents; evaluation-only
    sources are never read for training); `caches`: their train caches, named in errors and the data summary.
    `batch_size`: examples per step, or a schedule of them; `pad_to`: a batch whose size is not a multiple of it
    is padded to one with rows of zeros that no loss counts (trainer.allow_nondivisible_batch_size).
    """

    def __init__(
        self,
        views: Mapping[str, Any],
        config: DataConfig,
        batch_size: int | BatchSchedule,
        seed: int,
        part: ProcessSlice,
        caches: Mapping[str, str] | None = None,
        pad_to: int = 1,
    ):
        self.part = part
        self.sizes = batch_size if isinstance(batch_size, BatchSchedule) else BatchSchedule(batch_size)
        self.batch_size = self.sizes.fixed
        self.pad_to = pad_to
        self.pads = any(size % pad_to for size in self.sizes.distinct_sizes)
        """Whether some step's batch is padded: every batch then carries a loss_mask (the same fields each step)."""
        self.config = config
        self.caches = dict(caches or {})
        schedule = data_schedule(config)
        self.names = schedule.names
        self.windows = dict(views)
        ordered = {name: _ordered(v, source_shuffle(config, name), self._seed(seed, name)) for name, v in views.items()}
        layout = MixtureLayout(schedule, batch_size=self.sizes, block_size=config.mixture_block_size, seed=seed)
        # A single source starts over at its end, as it always has: stop_strategy is a mixture's key.
        stop = config.stop_strategy if config.is_mixture else "restart"
        self.examples = MixtureExamples(ordered, layout, stop_strategy=stop, timeout=DATA_TIMEOUT_S)
        self._started = False

    def _seed(self, seed: int, name: str) -> int:
        return source_seed(seed, name) if self.config.is_mixture else seed

    @classmethod
    def from_caches(
        cls,
        data: PreparedData,
        config: DataConfig,
        seq_len: int,
        batch_size: int | BatchSchedule,
        seed: int,
        part: ProcessSlice,
        examples: Callable[[shard_cache.CacheReader, int], Any] = token_windows,
        pad_to: int = 1,
    ) -> TrainBatches:
        """The batches of the trained sources whose caches `data` names (they may still be building);
        `examples(reader, seq_len)` makes a cache's examples (lm_train.data.sft_data.example_view)."""
        caches = {name: data.sources[name].train for name in data_schedule(config).trained()}
        views = {
            name: examples(shard_cache.open_cache(c, timeout=DATA_TIMEOUT_S), seq_len) for name, c in caches.items()
        }
        return cls(views, config, batch_size, seed, part, caches, pad_to)

    def _wait_for_first_examples(self) -> None:
        """Training starts once every trained source has committed its first example (a source that ends with
        none is a clear error, not a hang)."""
        for name, windows in self.windows.items():
            try:
                windows.wait_for_examples(1, timeout=DATA_TIMEOUT_S)
            except IndexError:
                raise DataError(self._no_example_message(name, windows.seq_len)) from None
        self._started = True

    def _no_example_message(self, name: str, seq_len: int) -> str:
        if self.config.is_mixture or name not in self.caches:
            return (
                f"{source_key(self.config, name)}: this source's training data has no example of {seq_len} "
                "tokens. Give it more text, a shorter model.seq_len, or weight 0 (evaluation only)."
            )
        return _no_example_message(self.caches[name], seq_len)

    def indices(self, step: int) -> np.ndarray:
        """Global example positions of a step (this process's slice only)."""
        return self.part.of(self.sizes.positions(step))

    def rows(self, step: int) -> int:
        """The rows of `step`'s global batch as the step gets it: its size, padded where it does not divide."""
        return padded(self.sizes.size_at(step), self.pad_to)

    def batch(self, step: int) -> np.ndarray | dict[str, np.ndarray]:
        """This process's examples of `step`: int32 [batch_size / process count, seq_len] (or a dict of such)."""
        if not self._started:
            self._wait_for_first_examples()
        if self.pads:
            return self._padded_batch(step)
        return self.examples.batch(step, process_index=self.part.index, process_count=self.part.count)

    def _padded_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's equal share of the padded global batch: its real rows, then rows of zeros, and a
        loss_mask that is false on every padding row (as Levanter pads with zeros that its loss mask leaves out)."""
        size, per = self.sizes.size_at(step), self.rows(step) // self.part.count
        start = min(self.part.index * per, size)
        real = min(start + per, size) - start
        # A process whose whole share is padding shapes its zeros on the step's first example.
        rows = self.examples.step_rows(step, start, start + real) if real else self.examples.step_rows(step, 0, 1)
        fields = dict(rows) if isinstance(rows, dict) else {"input_ids": rows}
        out: dict[str, np.ndarray] = {}
        for name, value in fields.items():
            full = np.zeros((per, *value.shape[1:]), dtype=value.dtype)
            full[:real] = value[:real]
            out[name] = full
        kept = np.zeros((per, out["input_ids"].shape[1]), dtype=np.bool_)
        kept[:real] = True
        out["loss_mask"] = out["loss_mask"] & kept if "loss_mask" in out else kept
        return out

    def batch_with_sources(self, step: int) -> dict[str, np.ndarray | dict[str, np.ndarray]]:
        """This process's examples of `step` and each one's source (an index into `names`), for DoReMi's step."""
        sources = self.examples.source_ids(step, process_index=self.part.index, process_count=self.part.count)
        return {"input_ids": self.batch(step), "source_ids": sources}

    def data_metrics(self, done: int) -> dict[str, float]:
        """A mixture's `data/<name>/tokens_seen` over steps [0, done) and `data/<name>/weight` in force at the
        last of them (none for a single source)."""
        if not self.config.is_mixture:
            return {}
        seen = self.examples.tokens_seen(done)
        weights = self.examples.weights_at(max(done - 1, 0))
        out: dict[str, float] = {}
        for name in self.names:
            out[f"data/{name}/tokens_seen"] = float(seen[name])
            out[f"data/{name}/weight"] = weights[name]
        return out

    def summary(self) -> DataSummary | None:
        """What a single source's training data held and left out (packing, truncation, skipped records), or None."""
        if self.config.is_mixture or SINGLE_SOURCE not in self.caches:
            return None
        view = self.windows[SINGLE_SOURCE]
        return data_summary(view, self.caches[SINGLE_SOURCE], finished=view.reader.finished)


def _no_example_message(cache_dir: str, seq_len: int) -> str:
    """Why a single source has no example, naming the inputs that gave no document (from the cache's ledger)."""
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
    cache: str | None,
    seq_len: int,
    batch_size: int,
    max_batches: int | None,
    part: ProcessSlice,
    examples: Callable[[shard_cache.CacheReader, int], Any] = token_windows,
) -> Iterator[np.ndarray | dict[str, np.ndarray]]:
    """One unshuffled pass over a validation cache, in full global batches (this process's rows of each)."""
    if cache is None:
        return
    reader = shard_cache.open_cache(cache, timeout=DATA_TIMEOUT_S)
    batches = examples(reader, seq_len).iter_batches(
        batch_size, process_index=part.index, process_count=part.count, timeout=DATA_TIMEOUT_S
    )
    yield from itertools.islice(batches, max_batches)
