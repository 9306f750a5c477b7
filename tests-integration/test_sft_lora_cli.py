"""SFT on chat records with LoRA, with the real CLI, checked against transformers, peft and plain pyarrow.

Two training runs and a rerun: a LoRA SFT run on the exported tiny Llama (its cache is checked against
`apply_chat_template`; the PEFT load, the merged export and the checkpoint's size against a full one), and the
same run killed with SIGKILL mid-run and rerun (bitwise equal to the uninterrupted one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import dist_ckpt
import trackers

pytestmark = pytest.mark.slow


def _run(cli, project, config: Path, run_dir: str, *extra: str):
    result = cli(["run", str(config), "--trainer.run_dir", run_dir, *extra], project.root)
    assert result.returncode == 0, result.output[-5000:]
    return result


@pytest.fixture(scope="module")
def lora_run(sft_project, cli):
    """The LoRA run (r=8 on q_proj and v_proj, packed chats, the bad record skipped) that also writes the merged
    model as it exports."""
    result = _run(cli, sft_project, sft_project.lora_config, "runs/lora", "--merged_hf_save_path", "runs/lora/merged")
    return sft_project.root / "runs" / "lora", result


def _hf_tokenizer(project):
    if os.environ.get("CI") != "true":
        pytest.importorskip("transformers")
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(project.tokenizer))


def _cache_rows(cache_root: Path) -> list[dict]:
    (train,) = [p for p in cache_root.glob("*/train") if p.is_dir()]
    rows = []
    for path in sorted((train / "chunks").rglob("*.parquet")):
        rows.extend(pq.read_table(path).to_pylist())
    return rows


def test_chat_cache_equals_apply_chat_template_and_masks_cover_the_assistant(sft_project, lora_run):
    run_dir, result = lora_run
    tokenizer = _hf_tokenizer(sft_project)
    expected: Counter = Counter()
    masks = {}
    for conversation in sft_project.train:
        ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
        tagged = tokenizer.apply_chat_template(
            conversation, chat_template=sft_project.tagged_template, return_dict=True, return_assistant_tokens_mask=True
        )
        assert list(tagged["input_ids"]) == list(ids)
        expected[tuple(ids)] += 1
        masks[tuple(ids)] = list(tagged["assistant_masks"])
    rows = _cache_rows(sft_project.root / "cache")
    assert Counter(tuple(r["input_ids"]) for r in rows) == expected  # every conversation, once; the bad one not
    for row in rows:
        assert [int(m) for m in row["loss_mask"]] == masks[tuple(row["input_ids"])]
    assert "1 bad records skipped" in result.output and "documents in" in result.output
    losses = [r["train/loss"] for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert losses[-1] < losses[0] - 0.2
    _check_example_views(sft_project, masks)


def _check_example_views(sft_project, masks: dict) -> None:
    """What the step reads from this cache, packed and padded, against the masks transformers gave."""
    import shard_cache
    from lm_train.data.sft_data import PaddedRows

    seq_len = 64
    (train,) = [p for p in (sft_project.root / "cache").glob("*/train") if p.is_dir()]
    by_prefix = {ids[:seq_len]: mask[:seq_len] for ids, mask in masks.items()}
    reader = shard_cache.open_cache(str(train))
    padded = PaddedRows(reader, seq_len)
    rows = padded.get_batch(np.arange(padded.num_examples_available()))
    assert set(rows) == {"input_ids", "loss_mask"} and len(rows["input_ids"]) == len(sft_project.train)
    for ids, loss_mask in zip(rows["input_ids"], rows["loss_mask"], strict=True):
        key = next(k for k in by_prefix if tuple(ids[: len(k)]) == k and not ids[len(k) :].any())
        target = np.asarray(by_prefix[key], bool)  # loss_mask[t]: the prediction of token t + 1 counts
        assert (loss_mask[: len(key) - 1] == target[1:]).all() and not loss_mask[len(key) - 1 :].any()
    packed = shard_cache.PackedSequences(reader, seq_len).get_batch(np.arange(8))
    fields = [packed[k] for k in ("segment_ids", "positions", "loss_mask")]
    for segments, positions, loss_mask in zip(*fields, strict=True):
        starts = np.flatnonzero(np.diff(segments, prepend=-2) != 0)
        assert (positions[starts[segments[starts] >= 0]] == 0).all()  # positions restart at each document
        ends = np.flatnonzero(np.diff(segments, append=-1) != 0)
        assert not loss_mask[ends].any()  # no prediction across a boundary or into padding


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _our_logits(checkpoint: Path, ids: list[int]) -> np.ndarray:
    import jax.numpy as jnp

    import named_tensors as nt
    from lm_train.run.checkpoints import load_model

    loaded = load_model(checkpoint)
    logits = loaded.model(nt.named(jnp.asarray([ids], jnp.int32), ("batch", "position")))
    return np.asarray(nt.permute(logits, ("batch", "position", "vocab")).array)


def _full_checkpoint(project, out: Path) -> Path:
    """The checkpoint of the same run without `lora`: every weight and its optimizer state, at step 0."""
    import dataclasses

    from tokenizers import Tokenizer

    import named_tensors as nt
    from lm_train.config import load_train_config
    from lm_train.optim import build_optimizer
    from lm_train.run.mesh import plan_mesh
    from lm_train.run.state import init_state

    config, _ = load_train_config([project.lora_config], [])
    config = dataclasses.replace(config, lora=None)
    vocab = Tokenizer.from_file(str(project.tokenizer / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    optimizer, _ = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    state = init_state(config, plan_mesh(config.trainer), nt.Axis("vocab", vocab), optimizer)
    dist_ckpt.save(state, out, step=0, block=True, progress=False)
    return out


def test_lora_checkpoint_holds_only_adapters_and_peft_loads_them(sft_project, lora_run, tmp_path):
    if os.environ.get("CI") != "true":
        pytest.importorskip("peft")
    import peft
    import torch
    import transformers

    run_dir = lora_run[0]
    checkpoint = run_dir / "checkpoints" / "step-8"
    saved = [k for k in dist_ckpt.load(checkpoint, progress=False) if k.startswith(".model")]
    assert saved and all(k.rsplit(".", 2)[-2] in ("lora_a", "lora_b") or "lora_" in k for k in saved), saved
    assert _size(checkpoint) < 0.05 * _size(_full_checkpoint(sft_project, tmp_path / "full"))

    ids = _hf_tokenizer(sft_project).apply_chat_template(sft_project.train[0], tokenize=True, return_dict=False)
    ours = _our_logits(checkpoint, list(ids))
    base = transformers.AutoModelForCausalLM.from_pretrained(sft_project.base_model).eval()
    with torch.no_grad():
        base_logits = base(torch.tensor([ids])).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base, str(run_dir / "hf" / "step-8")).eval()
        peft_logits = adapted(torch.tensor([ids])).logits.numpy()
        merged = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "merged" / "step-8").eval()
        merged_logits = merged(torch.tensor([ids])).logits.numpy()
    assert np.abs(ours - base_logits).max() > 1e-2  # the adapters were trained: the comparison can fail
    assert np.abs(ours - peft_logits).max() < 1e-4
    assert np.abs(ours - merged_logits).max() < 1e-4


def _wait_for_checkpoint(process: subprocess.Popen, checkpoints: Path, name: str, timeout: float = 300) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)
            latest = dist_ckpt.latest(checkpoints) if checkpoints.exists() else None
        if latest is not None and latest.name == name:
            return
        time.sleep(0.05)
    pytest.fail(f"no {name} under {checkpoints}: " + (process.stderr.read().decode()[-3000:] if process.stderr else ""))


def test_lora_run_killed_mid_run_resumes_bitwise_and_exports_the_same_adapter(
    sft_project, lora_run, cli, lm_train_command
):
    run_dir = sft_project.root / "runs" / "lora-killed"
    args = ["run", str(sft_project.lora_config), "--trainer.run_dir", str(run_dir)]
    env = dict(os.environ, LM_TRAIN_STEP_DELAY_S="0.4")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    process = subprocess.Popen(
        [*lm_train_command, *args], cwd=sft_project.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        _wait_for_checkpoint(process, run_dir / "checkpoints", "step-4")
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL
    assert dist_ckpt.latest(run_dir / "checkpoints").name in {"step-4", "step-6"}
    rerun = cli(args, sft_project.root)
    assert rerun.returncode == 0, rerun.output[-5000:]
    assert "resuming from" in rerun.output
    reference = dist_ckpt.load(lora_run[0] / "checkpoints" / "step-8", progress=False)
    resumed = dist_ckpt.load(run_dir / "checkpoints" / "step-8", progress=False)
    assert reference.keys() == resumed.keys()
    for key in reference:  # adapters, optimizer state, step and key: all of it
        assert np.asarray(reference[key]).tobytes() == np.asarray(resumed[key]).tobytes(), key

    out = sft_project.root / "exported-adapter"
    result = cli(["export-hf", str(run_dir / "checkpoints" / "step-8"), str(out), "--lora"], sft_project.root)
    assert result.returncode == 0, result.output[-3000:]
    ours = (out / "adapter_model.safetensors").read_bytes()
    assert ours == (lora_run[0] / "hf" / "step-8" / "adapter_model.safetensors").read_bytes()
