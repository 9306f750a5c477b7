"""`lm-train dpo` end to end: a tiny model learns a preference rule (accuracy and margin read from metrics.jsonl,
with the pair cache's build counts), a SIGKILL mid-run then a rerun ends bitwise equal to an uninterrupted run,
and a bad record is a clear error."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import dist_ckpt
import trackers

pytestmark = pytest.mark.slow

PROMPT_WORDS = [f"w{i}" for i in range(16)]
GOOD = ["yes", "sure", "gladly", "right", "indeed"]
BAD = ["no", "never", "nope", "wrong", "nah"]
EOS = "<|endoftext|>"


def preference_records(count: int, seed: int) -> list[dict]:
    """The rule: a chosen response is made of GOOD words only, a rejected one of BAD words only."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        prompt = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(2, 5))) + " ?\n"
        records.append(
            {
                "prompt": prompt,
                "chosen": " ".join(rng.choice(GOOD) for _ in range(rng.randint(2, 4))),
                "rejected": " ".join(rng.choice(BAD) for _ in range(rng.randint(2, 4))),
            }
        )
    return records


def word_tokenizer(path: Path) -> None:
    """A word-level tokenizer.json over the rule's words (whitespace-split, so offsets are exact)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [EOS, "[UNK]", "?", *PROMPT_WORDS, *GOOD, *BAD]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([EOS])
    tokenizer.save(str(path))


CONFIG = """\
data:
  train_urls: ["pairs.jsonl"]
  tokenizer: tokenizer.json
  cache_dir: cache
  chunk_size: 32
  shuffle: 64
model:
  type: gpt2
  seq_len: 16
  hidden_dim: 32
  num_heads: 2
  num_layers: 2
  gradient_checkpointing: false
dpo:
  beta: 0.5
trainer:
  seed: 2
  mp: f32
  num_train_steps: 12
  train_batch_size: 16
  log_every: 2
  checkpointer:
    save_interval: 1h
    keep:
      - every: 2
optimizer:
  learning_rate: 3.0e-3
  warmup: 0
"""


@pytest.fixture(scope="module")
def dpo_project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dpo")
    word_tokenizer(root / "tokenizer.json")
    records = preference_records(192, seed=0)
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (root / "dpo.yaml").write_text(CONFIG, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def reference_run(dpo_project, cli) -> Path:
    result = cli(["dpo", "dpo.yaml", "--trainer.run_dir", "runs/reference"], dpo_project)
    assert result.returncode == 0, result.output[-5000:]
    assert "DPO reference model: the initial weights" in result.output
    return dpo_project / "runs" / "reference"


def test_dpo_learns_the_rule_accuracy_and_margin_rise(reference_run):
    rows = [r for r in trackers.read_jsonl(reference_run / "metrics.jsonl") if "dpo/accuracy" in r]
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10, 12]
    for key in ("dpo/reward_margin", "dpo/chosen_logp", "dpo/rejected_logp", "dpo/chosen_reward", "train/loss"):
        assert all(np.isfinite(r[key]) for r in rows), key
    accuracy = [r["dpo/accuracy"] for r in rows]
    margin = [r["dpo/reward_margin"] for r in rows]
    assert min(accuracy[-2:]) >= 0.9, accuracy  # well above chance
    assert margin[-1] > margin[0] + 1.0 and margin[-1] > 0, margin
    # The policy moved its probability from the rejected responses to the chosen ones.
    assert rows[-1]["dpo/chosen_reward"] > 0 > rows[-1]["dpo/rejected_reward"]
    assert rows[-1]["train/loss"] < np.log(2.0) - 0.3
    # Each step scores 2 sequences of seq_len per pair: tokens/s counts both.
    assert rows[-1]["throughput/tokens_per_second"] > 0
    assert dist_ckpt.latest(reference_run / "checkpoints").name == "step-12"
    # The cache of pairs built while the run trained: its last counts are the finished cache's, read with pyarrow.
    last = {k: v for r in trackers.read_jsonl(reference_run / "metrics.jsonl") for k, v in r.items() if "preproc" in k}
    [cache] = (reference_run.parents[1] / "cache").glob("*/train")
    tables = [pq.read_table(p, columns=["input_ids"]) for p in sorted(cache.glob("chunks/*/*.parquet"))]
    assert last["preprocessing/docs"] == sum(t.num_rows for t in tables) == 192
    assert last["preprocessing/tokens"] == sum(len(ids) for t in tables for ids in t.column("input_ids").to_pylist())
    assert last["preprocessing/shards_finished"] == 1 and last["preprocessing/tokens_per_second"] > 0


def model_leaves(checkpoint: Path) -> dict[str, np.ndarray]:
    flat = dist_ckpt.load(checkpoint, progress=False)
    return {k: v for k, v in flat.items() if k.startswith((".model", ".opt_state"))}


def wait_for_checkpoint(process: subprocess.Popen, checkpoints: Path, name: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with warnings.catch_warnings():  # a checkpoint being written right now is "torn" until committed
            warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)
            latest = dist_ckpt.latest(checkpoints) if checkpoints.exists() else None
        if latest is not None and latest.name == name:
            return
        time.sleep(0.05)
    if process.poll() is not None:
        pytest.fail("the run ended before the signal: " + process.stderr.read().decode()[-3000:])
    pytest.fail(f"no {name} under {checkpoints} within {timeout} s")


def test_kill_9_mid_dpo_run_then_rerun_is_bitwise_equal(dpo_project, reference_run, cli, lm_train_command):
    run_dir = dpo_project / "runs" / "killed"
    env = dict(os.environ, LM_TRAIN_STEP_DELAY_S="0.4")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    command = [*lm_train_command, "dpo", "dpo.yaml", "--trainer.run_dir", str(run_dir)]
    process = subprocess.Popen(command, cwd=dpo_project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_checkpoint(process, run_dir / "checkpoints", "step-4")
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL
    stopped_at = dist_ckpt.latest(run_dir / "checkpoints")
    assert stopped_at.name in {"step-4", "step-6"}
    rerun = cli(["dpo", "dpo.yaml", "--trainer.run_dir", str(run_dir)], dpo_project)
    assert rerun.returncode == 0, rerun.output[-5000:]
    assert f"resuming from {stopped_at}" in rerun.output
    left, right = model_leaves(reference_run / "checkpoints/step-12"), model_leaves(run_dir / "checkpoints/step-12")
    assert left.keys() == right.keys() and any(k.startswith(".model") for k in left)
    assert not any("reference" in k for k in left)  # the reference is rebuilt, never stored
    for key in left:
        assert left[key].tobytes() == right[key].tobytes(), f"{key} differs after the resume"
    logged = {r["step"]: r for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if "dpo/accuracy" in r}
    expected = {r["step"]: r for r in trackers.read_jsonl(reference_run / "metrics.jsonl") if "dpo/accuracy" in r}
    for key in ("train/loss", "dpo/reward_margin", "dpo/accuracy"):
        assert logged[12][key] == expected[12][key], key


def test_a_bad_preference_record_names_its_file_and_line(dpo_project, cli):
    records = [json.dumps(r) for r in preference_records(5, seed=1)]
    records.insert(3, json.dumps({"prompt": "w1 ?\n", "chosen": "yes"}))  # line 4: no rejected response
    (dpo_project / "bad.jsonl").write_text("\n".join(records) + "\n", encoding="utf-8")
    overrides = ["--data.train_urls", '["bad.jsonl"]', "--data.cache_dir", "bad-cache", "--trainer.run_dir", "runs/bad"]
    result = cli(["dpo", "dpo.yaml", *overrides], dpo_project)
    assert result.returncode == 2, result.output[-5000:]
    assert "Traceback" not in result.output
    assert "bad.jsonl:4" in result.output and "'rejected'" in result.output, result.output[-3000:]
    assert "--dpo.on_bad_input skip" in result.output  # the message says how to skip such records instead
    assert dist_ckpt.latest(dpo_project / "runs" / "bad" / "checkpoints") is None


EQUAL_RESPONSES = {
    "preference": {"prompt": "w1 ?\n", "chosen": "yes sure", "rejected": "yes sure"},
    "preference_chat": {
        "prompt": [{"role": "user", "content": "w1 ?"}],
        "chosen": [{"role": "assistant", "content": "yes"}],
        "rejected": "yes",  # the same assistant turn, written as a plain string
    },
}


@pytest.mark.parametrize("fmt", sorted(EQUAL_RESPONSES))
def test_a_pair_of_equal_responses_is_refused_by_file_and_line(dpo_project, cli, fmt):
    records = [json.dumps(r) for r in preference_records(4, seed=2)]
    if fmt == "preference_chat":
        records = [
            json.dumps(
                {"prompt": [{"role": "user", "content": r["prompt"]}], "chosen": r["chosen"], "rejected": r["rejected"]}
            )
            for r in preference_records(4, seed=2)
        ]
    records.insert(2, json.dumps(EQUAL_RESPONSES[fmt]))  # line 3
    name = f"equal-{fmt}.jsonl"
    (dpo_project / name).write_text("\n".join(records) + "\n", encoding="utf-8")
    overrides = ["--data.train_urls", f'["{name}"]', "--data.cache_dir", f"equal-cache-{fmt}", "--dpo.format", fmt]
    overrides += ["--trainer.run_dir", f"runs/equal-{fmt}"]
    if fmt == "preference_chat":
        overrides += ["--dpo.chat_template", CHAT_TEMPLATE]
    result = cli(["dpo", "dpo.yaml", *overrides], dpo_project)
    assert result.returncode == 2, result.output[-5000:]
    assert "Traceback" not in result.output
    assert f"{name}:3" in result.output and "the same response" in result.output, result.output[-3000:]
    assert dist_ckpt.latest(dpo_project / "runs" / f"equal-{fmt}" / "checkpoints") is None


CHAT_TEMPLATE = (
    '{% for m in messages %}{{ m.role }} {{ m.content }}{% if m.role == "assistant" %} {{ eos_token }}{% endif %}'
    " {% endfor %}"
)


def test_chat_pairs_learn_the_rule_too(dpo_project, cli):
    """`dpo.format: preference_chat`: the prompt's messages, then the chosen or the rejected assistant turn, rendered
    by the chat template; only the response's assistant text is a target, and the rule is learnt as from text."""
    records = [
        {
            "prompt": [{"role": "user", "content": r["prompt"].strip()}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in preference_records(192, seed=3)
    ]
    (dpo_project / "chat_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    text = CONFIG.replace('train_urls: ["pairs.jsonl"]', 'train_urls: ["chat_pairs.jsonl"]')
    text = text.replace("cache_dir: cache", "cache_dir: chat-cache").replace("log_every: 2", "log_every: 4")
    chat = f"  beta: 0.5\n  format: preference_chat\n  chat_template: '{CHAT_TEMPLATE}'\n"
    text = text.replace("  beta: 0.5\n", chat)
    (dpo_project / "dpo_chat.yaml").write_text(text, encoding="utf-8")
    result = cli(["dpo", "dpo_chat.yaml", "--trainer.run_dir", "runs/chat"], dpo_project)
    assert result.returncode == 0, result.output[-5000:]
    rows = [r for r in trackers.read_jsonl(dpo_project / "runs/chat/metrics.jsonl") if "dpo/accuracy" in r]
    assert [r["step"] for r in rows] == [4, 8, 12]
    assert rows[-1]["dpo/accuracy"] >= 0.8 and rows[-1]["dpo/reward_margin"] > rows[0]["dpo/reward_margin"], rows
