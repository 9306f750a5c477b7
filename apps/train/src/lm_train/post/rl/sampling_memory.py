"""RL's serving engine as `lm-train rl` builds it, and its share of `lm-train plan --rl`: the KV cache, what else the
engine keeps between rollouts, and the peak of its prefill and decode programs (traced, never compiled)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import named_tensors as nt
from lm_models import inference_mode, init_paged_cache, supports_paging
from lm_train.config.schema import TrainLmConfig
from lm_train.errors import ConfigError
from lm_train.planning import liveness
from lm_train.planning.figures import SamplingMemory
from lm_train.planning.program import build_program
from lm_train.run.precision import parse_policy
from lm_train.serve.decoding import empty_state
from lm_train.serve.engine_config import EngineConfig
from lm_train.serve.pages import PagePool
from lm_train.serve.rows import build_rows
from lm_train.serve.step import WHOLE, EngineStep, RowPatch

PAGE_SIZE = 16
MAX_SEQUENCES = 64
"""The engine decodes at most this many completions together (rl.group_size is at most 64 too)."""


def check_servable(config: TrainLmConfig) -> None:
    """A ConfigError unless the serving engine can sample from the model family (through its paged KV cache)."""
    model = eqx.filter_eval_shape(lambda: config.model.build(nt.Axis("vocab", 8), key=jax.random.key(0)))
    if not supports_paging(model):
        raise ConfigError(
            f"model.type ({type(config.model).__name__}): lm-train rl samples with the serving engine, which decodes "
            f"through a paged KV cache, and {type(model).__name__} cannot use one "
            "(DeepSeek-V3's cache holds latents); train a family the engine serves (docs/serving.md)."
        )


def engine_config(config: TrainLmConfig, longest_prompt: int, waiting: int) -> EngineConfig:
    """The engine of a run whose longest prompt is `longest_prompt` tokens: one row per completion decoded together
    (G x B, at most 64), each with the pages of its prompt and rl.max_new_tokens, and `waiting` requests queued."""
    rl = config.rl
    rows = min(rl.prompts_per_step * rl.group_size, MAX_SEQUENCES)
    # The last sampled token is never fed back, so a row holds prompt + max_new_tokens - 1 positions (Engine's own
    # reservation); page 0 is the engine's null page.
    per_row = -(-max(longest_prompt, longest_prompt + rl.max_new_tokens - 1) // PAGE_SIZE)
    return EngineConfig(
        page_size=PAGE_SIZE,
        num_pages=1 + rows * per_row,
        max_seqs=rows,
        prefill_rows=min(rl.prompts_per_step, 8),
        prefill_chunk=min(config.model.Pos.size, 128),
        max_waiting=waiting + 1,
    )


def _is_shape(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _bytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _temporaries(fn: Any, model: Any, donated: tuple, rest: tuple, upcast: bool) -> int:
    """Bytes a program of the engine needs beyond its arguments: its temporaries and its outputs but those it writes
    over, which it returns first (the engine donates the cache, the counts and the decode rows' state)."""
    arrays, static = eqx.partition(model, _is_shape)
    closed = jax.make_jaxpr(lambda a, *args: fn(eqx.combine(a, static), *args))(arrays, *donated, *rest)
    program, values = build_program(closed, upcast_bf16=upcast)
    written_over = set(program.outputs[: len(jax.tree.leaves(donated))])
    return liveness.peak_bytes(program, values, free_outputs=written_over).bytes


def sampling_memory(config: TrainLmConfig, vocab_size: int, platform: str) -> SamplingMemory:
    """What sampling holds beside the train step, per device, for prompts up to the context's limit (model.seq_len
    less rl.max_new_tokens, the longest that the run's prompt check lets through)."""
    rl, seq_len = config.rl, config.model.Pos.size
    longest = seq_len - rl.max_new_tokens
    engine = engine_config(config, longest, rl.prompts_per_step)
    policy = parse_policy(config.trainer.mp)
    compute, params = jnp.dtype(policy.compute_dtype), jnp.dtype(policy.param_dtype)
    Vocab = nt.Axis("vocab", vocab_size)
    model = eqx.filter_eval_shape(lambda: config.model.build(Vocab, key=jax.random.key(0)))

    def cast(x: Any) -> Any:
        floating = isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(x.shape, compute) if floating else x

    model = inference_mode(jax.tree.map(cast, model))
    # The engine's model is the state's weights cast to the compute dtype: the same arrays when that is the
    # parameters' dtype, else a copy, which the engine keeps between rollouts.
    copy = _bytes(eqx.filter(model, _is_shape)) if compute != params else 0
    max_positions = int(getattr(config.model, "max_positions", None) or seq_len)
    num_pages = engine.num_pages or 2
    cache = jax.eval_shape(lambda: init_paged_cache(config.model, num_pages, PAGE_SIZE, compute))
    counts = jax.ShapeDtypeStruct((engine.max_seqs + 1, vocab_size), jnp.int32)
    pool, pages_per_seq = PagePool(num_pages, PAGE_SIZE), -(-max_positions // PAGE_SIZE)

    def shapes(rows: Any) -> Any:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rows)

    step = EngineStep(16)  # EngineConfig's default decode_steps, as the RL engine runs
    # A decode call whose patch replaces every row, on the state the engine keeps on the device between calls.
    state = shapes(empty_state(engine.max_seqs, pages_per_seq))
    patch = shapes(RowPatch(np.full(engine.max_seqs, WHOLE, np.int32), empty_state(engine.max_seqs, pages_per_seq),
                            np.int32(16)))  # fmt: skip
    R, C = engine.prefill_rows, engine.prefill_chunk
    prefill_rows = build_rows([None] * R, C, [0] * R, [0] * R, pool, pages_per_seq, engine.max_seqs)
    upcast = platform == "cpu" and compute.itemsize == 2
    decode = _temporaries(
        lambda m, cache, counts, state, patch: step._decode((m, patch), cache, counts, state),
        model, (cache, counts, state), (patch,), upcast,
    )  # fmt: skip
    prefill = _temporaries(
        lambda m, cache, counts, rows: step._step((m, rows), cache, counts),
        model, (cache, counts), (shapes(prefill_rows),), upcast,
    )  # fmt: skip
    positions = (num_pages - 1) * PAGE_SIZE // engine.max_seqs
    return SamplingMemory(
        kv_cache_bytes=_bytes(cache),
        kv_cache_note=(
            f"({engine.max_seqs} rows x {positions} positions, paged, {compute.name}; sized for prompts up to "
            f"{longest} tokens)"
        ),
        kept_bytes=_bytes(counts) + copy,
        buffers_bytes=max(decode, prefill),
        buffers_note=f"(the larger of {'decode' if decode >= prefill else 'prefill'}'s, its temporaries and outputs)",
        decode_bytes=decode,
        prefill_bytes=prefill,
    )
