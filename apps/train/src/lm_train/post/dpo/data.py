"""DPO's data: a cache of preference pairs built from data.train_urls, and each step's batch of pairs from it."""

from __future__ import annotations

from typing import Any

import numpy as np

import shard_cache
from lm_train.data import DATA_TIMEOUT_S
from lm_train.data.batches import ProcessSlice
from lm_train.data.build_metrics import LatestBuildMetrics
from lm_train.data.caches import PreparedData, cache_tag
from lm_train.data.inputs import resolve_inputs
from lm_train.data.tokenizer import provide_tokenizer, wait_for_tokenizer
from lm_train.errors import DataError
from lm_train.run.preflight import RunSetup
from lm_train.run.train_inputs import TrainInputs

PAIR_FIELDS = ("input_ids", "loss_mask", "rejected_input_ids", "rejected_loss_mask")
"""The batch fields of a step of pairs (shard_cache.preferences' PAIR_FIELDS)."""


def prepare_preference_data(setup: RunSetup) -> PreparedData:
    """The tokenizer and the cache of pairs: found finished, resumed, or built in the background."""
    config, dpo = setup.config.data, setup.config.dpo
    inputs = resolve_inputs(config)
    main = setup.is_main
    tokenizer = provide_tokenizer(config, inputs, progress=main) if main else wait_for_tokenizer(config)
    # The format is in the folder's name: the same files read as text pairs or as chat pairs are other caches.
    cache = f"{config.cache_dir.rstrip('/')}/{cache_tag(tokenizer, config)}-{dpo.format}/train"
    if not setup.is_main:
        return PreparedData(tokenizer, cache, None, [])
    processor = shard_cache.preference_processor(dpo.format, tokenizer, chat_template=dpo.chat_template)
    watched = LatestBuildMetrics()
    build = shard_cache.start_build(
        inputs.train,
        cache,
        processor=processor,
        fmt=inputs.fmt,
        chunk_size=config.chunk_size,
        on_bad_input=dpo.on_bad_input,
        num_workers=config.num_workers,
        in_process=config.build_in_process,
        progress=setup.is_main,
        metrics_callback=watched,
    )
    return PreparedData(tokenizer, cache, None, [build], watched)


class PairBatches:
    """This process's pairs of each step's global batch, in the order `data.shuffle` says (as TrainBatches)."""

    def __init__(self, data: PreparedData, seq_len: int, batch_size: int, seed: int, shuffle: Any, part: ProcessSlice):
        assert data.train_cache is not None  # prepare_preference_data always builds the pairs' cache
        self.batch_size, self.part, self.seed, self.cache_dir = batch_size, part, seed, data.train_cache
        reader = shard_cache.open_cache(data.train_cache, timeout=DATA_TIMEOUT_S)
        pad_id = data.tokenizer().token_to_id("<|endoftext|>") or 0  # masked out either way
        self.pairs = shard_cache.PreferencePairs(reader, seq_len, pad_id=pad_id)
        if shuffle is True:
            self._order = None  # the full permutation needs the final count; made on first use
        elif shuffle is False:
            self._order = self.pairs
        else:
            self._order = self.pairs.era_shuffled(seed, int(shuffle))

    def _source(self) -> Any:
        if self._order is None:
            self._order = self.pairs.shuffled(self.seed, timeout=DATA_TIMEOUT_S)
        return self._order

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's pairs of `step`: PAIR_FIELDS, each [batch_size / process count, seq_len]."""
        start = step * self.batch_size
        positions = self.part.of(np.arange(start, start + self.batch_size, dtype=np.int64))
        source = self._source()
        final = self.pairs.final_num_examples()
        if final:  # epochs wrap around; positions inside the first epoch are unchanged
            positions = positions % final
        try:
            return source.get_batch(positions, timeout=DATA_TIMEOUT_S)
        except shard_cache.ShardCacheError as e:
            if "on_bad_input" not in str(e):
                raise
            # shard-cache names its own option; here the setting is a config key.
            raise DataError(f"{e} For lm-train dpo: --dpo.on_bad_input skip skips and counts such records.") from None
        except IndexError:  # the build finished with fewer pairs than this step asked for
            final = self.pairs.wait_for_final(timeout=DATA_TIMEOUT_S)
            if final == 0:
                raise DataError(
                    f"The preference data has no pair (cache {self.cache_dir}): every record was skipped or the "
                    "inputs are empty. Check data.train_urls and dpo.format."
                ) from None
            return source.get_batch(positions % final, timeout=DATA_TIMEOUT_S)


def preference_inputs(setup: RunSetup, data: PreparedData) -> TrainInputs:
    """The loop's inputs for DPO: batches of pairs; no evaluation (validation pairs are not read yet)."""
    config, t = setup.config, setup.config.trainer
    batch_size = t.batch_schedule.fixed
    assert batch_size is not None  # TrainingKind.check_batch_sizes refuses a schedule of several sizes
    batches = PairBatches(data, config.model.Pos.size, batch_size, t.seed, config.data.shuffle, setup.part)
    return TrainInputs(batches.batch, PAIR_FIELDS, lambda model, step: None, False, lambda step: {})
