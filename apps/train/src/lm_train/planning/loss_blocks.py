"""The loss in vocabulary blocks by default where one microbatch's full logits would not fit in a device's memory.

lm_models scores the vocabulary in blocks by default on accelerators (`vocabulary_block_size`); on CPU it does not,
since there the logits usually fit in RAM. Where they do not, the run and its plan set `model.cross_entropy_block_size`
to the accelerators' block size, and config.yaml records it. The decision reads the host's RAM (or
LM_TRAIN_MEMORY_LIMIT), not what is free at the moment, so that a rerun decides the same and resumes bitwise.
"""

from __future__ import annotations

import dataclasses

from lm_train.config.schema import TrainLmConfig

F32_BYTES = 4  # the loss computes its logits in float32 whatever the compute dtype


def logits_bytes(config: TrainLmConfig, vocab_size: int, rows: int) -> int:
    """The bytes of one microbatch's full float32 logits on one device, `rows` sequences of it."""
    return rows * config.model.seq_len * vocab_size * F32_BYTES


def _soft_capped(model: object) -> bool:
    """Whether the model soft-caps its logits (Gemma 2), which the blockwise loss cannot score."""
    spec = getattr(model, "decoder_spec", None)
    return spec is not None and spec().final_logit_soft_cap is not None


def with_loss_blocks(
    config: TrainLmConfig, vocab_size: int, rows: int, platform: str, memory_bytes: int
) -> TrainLmConfig:
    """The config with `model.cross_entropy_block_size` set where, on CPU devices of `memory_bytes` each, one
    microbatch's logits (`rows` sequences per device) would not fit; otherwise the config as it is."""
    model = config.model
    if platform != "cpu" or getattr(model, "cross_entropy_block_size", 0) is not None or _soft_capped(model):
        return config  # an accelerator's rule is lm_models' own; a size the user gave stays
    if logits_bytes(config, vocab_size, rows) <= memory_bytes:
        return config
    from lm_models import ACCELERATOR_BLOCK_SIZE

    return dataclasses.replace(
        config, model=dataclasses.replace(model, cross_entropy_block_size=ACCELERATOR_BLOCK_SIZE)
    )
