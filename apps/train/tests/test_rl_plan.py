"""`lm-train plan --rl` counts what sampling holds beside the train step: the serving engine's KV cache as `lm-train rl`
builds it, what else the engine keeps, and its programs' buffers; the decode program's figure is within 15% of XLA's
own for the compiled program, and the peak is the train step beside the engine or sampling beside the state."""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import named_tensors as nt
from lm_train.config import load_train_config
from lm_train.errors import ConfigError
from lm_train.kinds import training_kind
from lm_train.planning.report import plan_json, render_text
from lm_train.planning.setup import plan_for
from lm_train.post.rl.sampling_memory import engine_config, sampling_memory
from lm_train.serve.decoding import empty_state
from lm_train.serve.engine import Engine
from lm_train.serve.step import WHOLE, RowPatch

VOCAB, SEQ, HIDDEN, HEADS, LAYERS, NEW, B, G = 64, 40, 32, 2, 2, 8, 2, 4
CONFIG = f"""\
data:
  train_urls: ["prompts.jsonl"]
  tokenizer: tokenizer.json
model: {{type: gpt2, seq_len: {SEQ}, hidden_dim: {HIDDEN}, num_heads: {HEADS}, num_layers: {LAYERS}}}
rl:
  group_size: {G}
  prompts_per_step: {B}
  max_new_tokens: {NEW}
  rewards: [{{fn: "lm_train.post.rl.rewards:exact_answer"}}]
trainer: {{seed: 0, mp: f32, num_train_steps: 2, train_batch_size: {B * G}, run_dir: runs/rl}}
"""
CONFIGS = Path(__file__).parents[3] / "configs"
DEEPSEEK_RL = ["--data.builtin", "null", "--data.train_urls", "[p.jsonl]", "--data.tokenizer", "t.json"]
DEEPSEEK_RL += ["--rl.rewards", '[{fn: "lm_train.post.rl.rewards:exact_answer"}]', "--trainer.train_batch_size", "64"]


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl_plan") / "rl.yaml"
    path.write_text(CONFIG, encoding="utf-8")
    return path


def _xla_peak(compiled) -> tuple[int, int]:
    a = compiled.memory_analysis()
    args = int(a.argument_size_in_bytes)
    return args, args + int(a.output_size_in_bytes) - int(a.alias_size_in_bytes) + int(a.temp_size_in_bytes)


def test_the_engines_decode_program_is_within_15_percent_of_xlas(config_path):
    """The engine `lm-train rl` builds for prompts up to the context's limit, its decode program compiled on one CPU
    device: XLA's arguments are the model, the cache, the counts, the rows' state and the call's patch; the plan's
    figure for them plus its traced buffers is within 15% of XLA's peak."""
    config, _ = load_train_config([config_path])
    planned = sampling_memory(config, VOCAB, "cpu")
    model = config.model.build(nt.Axis("vocab", VOCAB), key=jax.random.key(0))
    engine = Engine(model, engine_config(config, SEQ - NEW, B))

    # The pool, by the architecture: G x B rows of the longest prompt and the new tokens, in 16-position pages, per
    # layer keys and values of every head (GPT-2: heads x hidden / heads), f32; page 0 is the null page.
    pages = 1 + B * G * -(-(SEQ - 1) // 16)
    assert engine.pool.num_pages == pages
    assert planned.kv_cache_bytes == sum(x.nbytes for x in jax.tree.leaves(engine.cache))
    assert planned.kv_cache_bytes >= LAYERS * 2 * pages * 16 * HIDDEN * 4
    assert planned.kept_bytes == (B * G + 1) * VOCAB * 4  # the penalty counts: no weight copy in f32

    # A call whose patch replaces every row of the state that the engine keeps on the device.
    state = engine.decoder.state
    patch = RowPatch(np.full(B * G, WHOLE, np.int32), empty_state(B * G, engine.pages_per_seq), np.int32(16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # jax notes that donated buffers are not reused
        lowered = engine.step_fn._decode_jitted.lower((engine.model, patch), engine.cache, engine.counts, state)
        args, peak = _xla_peak(lowered.lowered.compile())
    weights = sum(x.nbytes for x in jax.tree.leaves(engine.model) if isinstance(x, jax.Array))
    rows_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves((state, patch)))
    ours_args = weights + planned.kv_cache_bytes + planned.kept_bytes + rows_bytes
    assert ours_args == args
    ratio = (ours_args + planned.decode_bytes) / peak
    print(f"decode: plan {ours_args + planned.decode_bytes} XLA {peak} ratio {ratio:.3f}")
    assert 0.85 <= ratio <= 1.15


def test_plan_rl_shows_the_engine_beside_the_train_step(config_path):
    """The plan's JSON and text carry the engine's rows, and its peak (and verdict) is the larger of the train step
    beside the engine and sampling beside the state."""
    config, _ = load_train_config([config_path])
    plan, _ = plan_for(config, "cpu:1", vocab_size=VOCAB, kind=training_kind("rl"))
    rl = plan_json(plan)
    s, e = rl["sampling"], rl["estimate"]
    held = s["kv_cache_bytes"] + s["kept_bytes"]
    state = e["argument_bytes"] - rl["batch_bytes"]
    assert rl["peak_bytes_per_device"] == max(e["peak_bytes"] + held, state + held + s["buffers_bytes"])
    assert rl["fits"] and rl["margin_bytes"] == rl["usable_bytes_per_device"] - rl["peak_bytes_per_device"]
    assert s["buffers_bytes"] == max(s["decode_bytes"], s["prefill_bytes"]) > 0
    text = render_text(plan, "rl.yaml")
    assert "KV cache (sampling engine)" in text and "sampling buffers" in text, text
    verdict = next(line for line in text.splitlines() if "verdict" in line)
    assert f"peak {rl['peak_bytes_per_device'] / 2**30:.2f} GiB with sampling" in verdict, verdict


def test_a_family_the_engine_cannot_serve_is_refused_by_the_config_check():
    """DeepSeek-V3's decoding cache holds latents, which the engine's paged cache does not: `lm-train rl` and
    `lm-train plan --rl` refuse it in the kind's config check, naming the model and the fix."""
    config, _ = load_train_config([CONFIGS / "deepseek_v3_nano.yaml"], DEEPSEEK_RL)
    with pytest.raises(ConfigError, match=r"model\.type \(DeepseekV3Config\).*paged KV cache.*docs/serving\.md"):
        training_kind("rl").check_config(config)
