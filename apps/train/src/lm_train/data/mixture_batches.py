"""The examples of each step of a mixture: shard-cache's sampler over every trained source's token windows.

The global sequence of (source, example) is the sampler's, a pure function of (seed, weight schedule, batch size,
block size) and the step: the same for any number of processes, and a resumed run asks for the same steps again.
The per-source accounting behind `data/<name>/tokens_seen` is the sampler's closed form, computed on the host.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import shard_cache
from shard_cache import MixtureExamples, MixtureLayout, TokenWindows

from lm_train.config.data_config import DataConfig
from lm_train.config.mixture_keys import mixture_schedule, source_shuffle
from lm_train.data import DATA_TIMEOUT_S
from lm_train.data.batches import ProcessSlice
from lm_train.data.mixture_data import MixtureData
from lm_train.errors import DataError


def source_seed(seed: int, name: str) -> int:
    """The shuffle seed of one source: derived from the run's seed and the name, so sources are shuffled apart."""
    digest = hashlib.blake2b(f"lm-train-mixture-source:{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _FullShuffle:
    """`windows.shuffled(seed)`, made on first use: the full permutation needs the final size, which a source
    still being built learns only when its build ends, so asking for it up front would block the run's start."""

    def __init__(self, windows: TokenWindows, seed: int):
        self.base = windows
        self.seed = seed
        self._view = None
        self._lock = threading.Lock()

    def get_batch(self, indices: Any, timeout: float | None = None) -> np.ndarray:
        with self._lock:
            if self._view is None:
                self._view = self.base.shuffled(self.seed, timeout=DATA_TIMEOUT_S)
        return self._view.get_batch(indices, timeout)


def _ordered(windows: TokenWindows, shuffle: bool | int, seed: int) -> Any:
    if shuffle is True:
        return _FullShuffle(windows, seed)
    if shuffle is False:
        return windows
    return windows.era_shuffled(seed, int(shuffle))


class MixtureBatches:
    """This process's rows of each training step of a mixture, and the mixture's host-side accounting.

    `windows`: every trained source's token windows (evaluation-only sources are never read for training).
    """

    def __init__(
        self, windows: Mapping[str, TokenWindows], config: DataConfig, batch_size: int, seed: int, part: ProcessSlice
    ):
        self.part = part
        schedule = mixture_schedule(config)
        self.names = schedule.names
        self.windows = dict(windows)
        views = {
            name: _ordered(w, source_shuffle(config, name), source_seed(seed, name)) for name, w in self.windows.items()
        }
        layout = MixtureLayout(schedule, batch_size=batch_size, block_size=config.mixture_block_size, seed=seed)
        self.examples = MixtureExamples(views, layout, stop_strategy=config.stop_strategy, timeout=DATA_TIMEOUT_S)
        self._started = False

    @classmethod
    def from_caches(
        cls, data: MixtureData, config: DataConfig, seq_len: int, batch_size: int, seed: int, part: ProcessSlice
    ) -> MixtureBatches:
        """The batches of a mixture whose trained sources' caches `data` names (they may still be building)."""
        windows = {
            name: shard_cache.open_cache(data.sources[name].train, timeout=DATA_TIMEOUT_S).token_windows(seq_len)
            for name in mixture_schedule(config).trained()
        }
        return cls(windows, config, batch_size, seed, part)

    def _wait_for_first_examples(self) -> None:
        """Training starts once every trained source has committed its first example (a source that ends with
        none is a clear error, not a hang)."""
        for name, windows in self.windows.items():
            try:
                windows.wait_for_examples(1, timeout=DATA_TIMEOUT_S)
            except IndexError:
                raise DataError(
                    f"data.configs.{name}: this source's training data has no example of {windows.seq_len} tokens. "
                    "Give it more text, a shorter model.seq_len, or weight 0 (evaluation only)."
                ) from None
        self._started = True

    def batch(self, step: int) -> np.ndarray:
        """This process's examples of `step` as int32 [batch / processes, seq_len]."""
        if not self._started:
            self._wait_for_first_examples()
        return self.examples.batch(step, process_index=self.part.index, process_count=self.part.count)

    def batch_with_sources(self, step: int) -> dict[str, np.ndarray]:
        """This process's examples of `step` and each one's source (an index into `names`), for DoReMi's step."""
        sources = self.examples.source_ids(step, process_index=self.part.index, process_count=self.part.count)
        return {"input_ids": self.batch(step), "source_ids": sources}

    def data_metrics(self, done: int) -> dict[str, float]:
        """`data/<name>/tokens_seen` over steps [0, done) and `data/<name>/weight` in force at the last of them."""
        seen = self.examples.tokens_seen(done)
        weights = self.examples.weights_at(max(done - 1, 0))
        out: dict[str, float] = {}
        for name in self.names:
            out[f"data/{name}/tokens_seen"] = float(seen[name])
            out[f"data/{name}/weight"] = weights[name]
        return out
