"""`lm-train rl` end to end on a verifiable task a nano model learns on CPU: addition with the answer after `=`.

The fixture SFTs a nano GPT-2 in process on answers that are half the time off by one, so that it answers in the
format but often wrongly, and exports it. One RL run then raises greedy exact-answer accuracy on held-out sums
(measured with transformers, before and after) with a zero log-prob mismatch; half its prompts are chat messages,
sampled from the ids of transformers' apply_chat_template; its held-out prompts come from parquet, and two bad
prompt records are left out (rl.on_bad_prompt: skip), counted and named. Two short runs take two optimizer steps
per batch of completions (minibatches of half of it), with and without a KL penalty: the ratio moves, clipping acts,
and the penalty keeps the policy closer to the reference; a third such run killed with SIGKILL inside a batch's updates
and rerun ends bitwise equal to the first, sampled completions included. A LoRA run trains the adapters alone against
the base model as reference, and its PEFT export, applied by peft to the base, answers as the run evaluated. Bad input
is refused before sampling, through the CLI.
"""

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
import pytest
from cli_checks import assert_clear_error

import dist_ckpt
import trackers

pytestmark = pytest.mark.slow

EOS = "<|endoftext|>"
WORDS = [EOS, "[UNK]", "+", "=", *[str(i) for i in range(20)]]
SEQ_LEN = 16
STEPS = 12
HELD_OUT = 30
# The last half of the RL prompts are chat messages: a system message the template leaves out, and the sum as the
# user's. Rendered they are the same ids as the text prompts, so the run (and docs/rl.md's figures) is unchanged.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} {% endif %}"
)
SYSTEM = "Answer after ="  # out of the vocabulary but for `=`: rendered, it would be [UNK]s

CONFIG = f"""\
data:
  train_urls: ["prompts.jsonl"]
  validation_urls: ["held_out.jsonl"]
  tokenizer: tokenizer.json
  format: {{type: chat, chat_template: {json.dumps(CHAT_TEMPLATE)}}}
initialize_from_hf: sft
model:
  type: gpt2
  seq_len: {SEQ_LEN}
  hidden_dim: 64
  num_heads: 4
  num_layers: 2
  gradient_checkpointing: false
rl:
  group_size: 8
  prompts_per_step: 8
  max_new_tokens: 4
  rewards:
    - fn: lm_train.post.rl.rewards:exact_answer
      kwargs: {{marker: "="}}
    - fn: lm_train.post.rl.rewards:format_check
      weight: 0.1
      kwargs: {{pattern: "= \\\\d+"}}
trainer:
  seed: 0
  mp: f32
  num_train_steps: {STEPS}
  train_batch_size: 64
  log_every: 1
  steps_per_eval: 6
  checkpointer:
    save_interval: 1h
    keep:
      - every: 4
optimizer:
  learning_rate: 5.0e-4
  warmup: 0
  lr_schedule: constant
"""


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([EOS])
    tokenizer.save(str(path))


def _sft(root: Path, facts: list[tuple[int, int]]) -> None:
    """A nano GPT-2 trained on `a + b = answer <eos>` where the answer is a + b or, half the time, a + b + 1."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import hf_bridge
    import lm_models as lm
    import named_tensors as nt

    rng = np.random.default_rng(0)
    config = lm.Gpt2Config(seq_len=SEQ_LEN, hidden_dim=64, num_heads=4, num_layers=2, gradient_checkpointing=False)
    model = config.build(nt.Axis("vocab", len(WORDS)), key=jax.random.key(0))
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    def rows(count: int) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = np.zeros((count, SEQ_LEN), np.int32), np.zeros((count, SEQ_LEN), bool)
        for row in range(count):
            a, b = facts[rng.integers(len(facts))]
            answer = a + b + int(rng.random() < 0.5)
            tokens = [WORDS.index(str(a)), 2, WORDS.index(str(b)), 3, WORDS.index(str(answer)), 0]
            ids[row, : len(tokens)] = tokens
            mask[row, 2 : len(tokens) - 1] = True  # predict `=`, the answer and the end (not the question)
        return ids, mask

    @eqx.filter_jit
    def step(model, opt_state, ids, mask):
        def loss(m):
            names = ("batch", "position")
            return lm.next_token_loss(m, nt.named(ids, names), loss_mask=nt.named(mask, names)).array

        grads = eqx.filter_grad(loss)(model)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes python floats and int32 counts
            updates, opt_state = optimizer.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state

    for _ in range(300):
        ids, mask = rows(32)
        model, opt_state = step(model, opt_state, jnp.asarray(ids), jnp.asarray(mask))
    hf_bridge.save_pretrained(model, config, root / "sft", tokenizer=str(root / "tokenizer.json"))


def _records(facts: list[tuple[int, int]], chat_from: int | None = None) -> str:
    """A jsonl record per sum; from line `chat_from` on, its prompt is chat messages."""
    lines = []
    for line, (a, b) in enumerate(facts, start=1):
        prompt: str | list = f"{a} + {b}"
        if chat_from is not None and line >= chat_from:
            prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        lines.append(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")
    return "".join(lines)


@pytest.fixture(scope="module")
def rl_project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rl")
    _tokenizer(root / "tokenizer.json")
    facts = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(facts)
    _sft(root, facts)
    (root / "held_out.jsonl").write_text(_records(facts[:HELD_OUT]), encoding="utf-8")
    chat_from = (len(facts) - HELD_OUT) // 2 + 1
    (root / "prompts.jsonl").write_text(_records(facts[HELD_OUT:], chat_from), encoding="utf-8")
    (root / "rl.yaml").write_text(CONFIG, encoding="utf-8")
    return root


def greedy_accuracy(model_dir: Path, records_file: Path, adapter: Path | None = None) -> int:
    """Exact answers after `=` among greedy completions, by transformers (independent of the engine); with
    `adapter`, a PEFT adapter that peft applies to the model."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    transformers.logging.set_verbosity_error()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    right = 0
    for line in records_file.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        ids = tokenizer.encode(record["prompt"], add_special_tokens=False).ids
        out = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=0)
        text = tokenizer.decode(out[0, len(ids) :].tolist())
        right += text.startswith("=") and "".join(text[1:].split()) == record["answer"]
    return right


# The run reads its held-out prompts from parquet, and its prompts from a copy of prompts.jsonl with two bad records
# after the 70, which rl.on_bad_prompt: skip leaves out: it samples the same prompts as from prompts.jsonl itself.
BAD_RECORDS = [{"question": "1 + 2", "answer": "3"}, {"prompt": "1 + 3"}]  # no prompt; no answer


@pytest.fixture(scope="module")
def rl_run(rl_project, cli) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (rl_project / "skipping").mkdir()
    bad = "".join(json.dumps(r) + "\n" for r in BAD_RECORDS)
    (rl_project / "skipping" / "prompts.jsonl").write_text((rl_project / "prompts.jsonl").read_text() + bad)
    held_out = [json.loads(line) for line in (rl_project / "held_out.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(held_out), rl_project / "held_out.parquet")
    data = ["--data.train_urls", "[skipping/prompts.jsonl]", "--data.validation_urls", "[held_out.parquet]"]
    result = cli(["rl", "rl.yaml", "--trainer.run_dir", "runs/full", *data, "--rl.on_bad_prompt", "skip"], rl_project)
    assert result.returncode == 0, result.output[-5000:]
    assert "RL reference model: sft" in result.output
    skipped = "rl.on_bad_prompt: skip: left out 2 prompt records of data.train_urls (1 missing_prompt, 1 without a "
    where = rl_project / "skipping" / "prompts.jsonl"  # as the config names it once loaded: an absolute path
    skipped += f"field a reward reads); the first: {where}:71, {where}:72"
    assert skipped in result.output, result.output[-5000:]
    return rl_project / "runs" / "full"


def test_rl_raises_held_out_greedy_accuracy_with_zero_logprob_mismatch(rl_project, rl_run):
    before = greedy_accuracy(rl_project / "sft", rl_project / "held_out.jsonl")
    after = greedy_accuracy(rl_run / "hf" / f"step-{STEPS}", rl_project / "held_out.jsonl")
    print(f"held-out greedy exact answers: {before}/{HELD_OUT} before RL, {after}/{HELD_OUT} after")
    # The SFT model picks the right sum or the one above it about evenly; RL learns to leave out the + 1.
    assert before <= 0.7 * HELD_OUT and after >= before + 0.25 * HELD_OUT and after >= 0.8 * HELD_OUT, (before, after)
    # The run's own greedy evaluation of the held-out prompts (the engine, temperature 0) agrees with transformers.
    evals = {r["step"]: r for r in trackers.read_jsonl(rl_run / "metrics.jsonl") if "eval/rl/reward/mean" in r}
    assert sorted(evals) == [6, STEPS]
    assert evals[STEPS]["eval/rl/reward/exact_answer/mean"] == pytest.approx(after / HELD_OUT)
    rows = [r for r in trackers.read_jsonl(rl_run / "metrics.jsonl") if "rl/reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["rl/logprob_mismatch"] == 0.0  # the old policy's log-probs are the trainer's, bit for bit
        assert 0 <= row["rl/sampler_logprob_gap"] < 1e-4  # the engine's own decode agrees to f32 rounding
        assert 0 <= row["rl/clip_fraction"] <= 1 and 0 <= row["rl/zero_advantage_groups"] <= 1
        total = row["rl/reward/exact_answer/mean"] + 0.1 * row["rl/reward/format_check/mean"]
        assert row["rl/reward/mean"] == pytest.approx(total)
        assert 1 <= row["rl/completion_length/mean"] <= row["rl/completion_length/max"] <= 4
    assert rows[0]["rl/kl"] == 0.0 and max(r["rl/kl"] for r in rows) > 0  # step 1 samples the reference itself
    # Every completion was saved, G per prompt, with its rewards and advantage (zero mean within each group).
    saved = [json.loads(x) for x in (rl_run / "rollouts" / "step-000001.jsonl").read_text().splitlines()]
    assert len(saved) == 64 and {s["sample"] for s in saved} == set(range(8))
    assert all(int(s["where"].rpartition(":")[2]) <= 70 for s in saved)  # the bad records were left out
    for prompt in {s["prompt"] for s in saved}:
        group = [s["advantage"] for s in saved if s["prompt"] == prompt]
        assert abs(sum(group)) < 1e-4


def test_chat_prompts_reach_the_engine_as_apply_chat_templates_ids(rl_project, rl_run):
    """The run's chat-message prompts, rendered with data.format.chat_template, were sampled from the ids that
    transformers' apply_chat_template gives on the same tokenizer (with the generation prompt); its text prompts from
    their text's."""
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(rl_project / "tokenizer.json"))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    records = (rl_project / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    seen = {"chat": 0, "text": 0}
    for path in sorted((rl_run / "rollouts").glob("step-*.jsonl")):
        for entry in map(json.loads, path.read_text(encoding="utf-8").splitlines()):
            file, _, line = entry["where"].rpartition(":")
            assert file.endswith("prompts.jsonl"), entry["where"]
            prompt = json.loads(records[int(line) - 1])["prompt"]
            if isinstance(prompt, list):
                expected = reference.apply_chat_template(
                    prompt, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=False
                )
                # The template leaves the system message out: the ids are the user's text's, so the run is unchanged.
                assert list(expected) == tokenizer.encode(prompt[-1]["content"], add_special_tokens=False).ids
                seen["chat"] += 1
            else:
                expected = tokenizer.encode(prompt, add_special_tokens=False).ids
                seen["text"] += 1
            assert entry["prompt_tokens"] == list(expected), entry["where"]
    assert seen["chat"] and seen["text"], seen


# Two updates per batch of 64 completions, one per minibatch of 32; a permanent checkpoint every 3 steps, so that one
# falls between a batch's two updates (steps 3 and 4 train on the completions sampled at step 3).
UPDATES = ["--rl.updates_per_batch", "2", "--trainer.train_batch_size", "32", "--data.validation_urls", "[]"]
UPDATES += ["--trainer.checkpointer.keep", "[{every: 3}]"]
UPDATE_STEPS = 9


@pytest.fixture(scope="module")
def updates_runs(rl_project, cli) -> dict[str, Path]:
    """The same short run with two updates per batch, without and with a KL penalty."""
    runs = {}
    for name, kl in (("updates", "0.0"), ("updates_kl", "1.0")):
        steps = str(UPDATE_STEPS if kl == "0.0" else 6)
        args = ["--trainer.run_dir", f"runs/{name}", "--rl.kl_coef", kl, "--trainer.num_train_steps", steps]
        result = cli(["rl", "rl.yaml", *UPDATES, *args], rl_project)
        assert result.returncode == 0, result.output[-5000:]
        runs[name] = rl_project / "runs" / name
    return runs


def _train_rows(run_dir: Path) -> list[dict]:
    return [r for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if "rl/kl" in r]


def test_updates_per_batch_clip_and_kl_penalty(updates_runs):
    """A batch's second update is off-policy: its ratios move and some are clipped, while its first update's
    log-probs equal the sampler's exactly; a KL penalty keeps the logged KL lower at the same steps."""
    rows = _train_rows(updates_runs["updates"])
    assert [r["step"] for r in rows] == list(range(1, UPDATE_STEPS + 1))
    sampled = [r["step"] for r in rows if "rl/reward/mean" in r]
    assert sampled == [1, 3, 5, 7, 9]  # one rollout per two optimizer steps
    assert all(r["rl/logprob_mismatch"] == 0.0 for r in rows)  # measured on each batch's first update
    assert max(r["rl/clip_fraction"] for r in rows if r["step"] % 2 == 0) > 0
    assert all(r["rl/clip_fraction"] == 0.0 for r in rows if r["step"] % 2 == 1)  # ratio 1 on a first update
    saved = sorted(p.name for p in (updates_runs["updates"] / "rollouts").iterdir())
    assert saved == [f"step-{s:06d}.{ext}" for s in sampled for ext in ("jsonl", "npz")]
    penalised = {r["step"]: r["rl/kl"] for r in _train_rows(updates_runs["updates_kl"])}
    free = {r["step"]: r["rl/kl"] for r in rows}
    # Step 1 samples the reference itself, and the KL's gradient is zero there: the runs part from step 3 on.
    later = range(3, 7)
    print(
        f"mean rl/kl over steps 3-6: {np.mean([free[s] for s in later]):.4f} without the penalty, "
        f"{np.mean([penalised[s] for s in later]):.4f} with kl_coef 1"
    )
    assert penalised[1] == free[1] == 0.0
    assert np.mean([penalised[s] for s in later]) < 0.8 * np.mean([free[s] for s in later]), (penalised, free)


def _checkpointed(checkpoint: Path) -> dict[str, np.ndarray]:
    flat = dist_ckpt.load(checkpoint, progress=False)
    return {k: v for k, v in flat.items() if k.startswith((".model", ".opt_state"))}


def _latest(checkpoints: Path) -> str | None:
    """The newest committed checkpoint's name (one being written is not yet one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)
        latest = dist_ckpt.latest(checkpoints) if checkpoints.exists() else None
    return None if latest is None else latest.name


def test_kill_9_mid_rl_run_then_rerun_is_bitwise_equal(rl_project, updates_runs, cli, lm_train_command):
    """Killed after step 3's checkpoint, between the two updates of the batch sampled at step 3, and rerun: the
    weights, the optimizer and every sampled completion equal the uninterrupted run's."""
    run_dir, steps = rl_project / "runs" / "killed", [*UPDATES, "--trainer.num_train_steps", str(UPDATE_STEPS)]
    command = [*lm_train_command, "rl", "rl.yaml", "--trainer.run_dir", str(run_dir), *steps]
    env = dict(os.environ, LM_TRAIN_STEP_DELAY_S="0.3")
    process = subprocess.Popen(command, cwd=rl_project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while _latest(run_dir / "checkpoints") != "step-3" and process.poll() is None:
            assert time.monotonic() < deadline, "no step-3 checkpoint in 300 s"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()[-3000:]
    rerun = cli(["rl", "rl.yaml", "--trainer.run_dir", str(run_dir), *steps], rl_project)
    assert rerun.returncode == 0, rerun.output[-5000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'step-3'}" in rerun.output  # inside a batch's updates
    reference = updates_runs["updates"]
    last = f"checkpoints/step-{UPDATE_STEPS}"
    left, right = _checkpointed(reference / last), _checkpointed(run_dir / last)
    assert left.keys() == right.keys() and any(k.startswith(".model") for k in left)
    for key in left:
        assert left[key].tobytes() == right[key].tobytes(), f"{key} differs after the resume"
    names = sorted(p.name for p in (reference / "rollouts").iterdir())
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == names and len(names) == 10
    for name in names:
        assert (run_dir / "rollouts" / name).read_bytes() == (reference / "rollouts" / name).read_bytes(), name


BAD_INPUTS = {
    "group_size": (["--rl.group_size", "1"], {}, ("rl.group_size", "at least 2")),
    "import": (["--rl.rewards", '[{fn: "no_such_module.rewards:score"}]'], {}, ("rl.rewards[0].fn", "no_such_module")),
    "not_a_number": (["--rl.rewards", '[{fn: "my_rewards:text"}]'], {}, ("my_rewards:text", "not a number")),
    "too_long": ([], {"prompt": " + ".join(["1"] * 8), "answer": "8"}, ("prompts.jsonl:71", "model.seq_len")),
    "no_answer": ([], {"prompt": "1 + 2"}, ("prompts.jsonl:71", "'answer'", "exact_answer")),
    "updates": (
        ["--rl.updates_per_batch", "3", "--trainer.train_batch_size", "32"],
        {},
        ("rl.updates_per_batch (3)", "multiple of the minibatches"),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_before_sampling(rl_project, cli, case):
    overrides, extra_record, needles = BAD_INPUTS[case]
    project = rl_project / f"bad-{case}"
    project.mkdir()
    for name in ("tokenizer.json", "rl.yaml", "prompts.jsonl"):
        (project / name).write_bytes((rl_project / name).read_bytes())
    (project / "sft").symlink_to(rl_project / "sft")
    if extra_record:
        with (project / "prompts.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(extra_record) + "\n")
    # A reward of the user's own, importable from the project: it returns the completion's text, not a number.
    (project / "my_rewards.py").write_text("def text(record, completion):\n    return completion.strip()\n")
    env = {"PYTHONPATH": str(project)}
    result = cli(["rl", "rl.yaml", "--trainer.run_dir", "runs/bad", *overrides], project, env=env)
    assert_clear_error(result, *needles)
    assert not (project / "runs" / "bad" / "rollouts").exists()


def test_lora_rl_trains_the_adapters_only_against_the_base(rl_project, cli):
    """LoRA with RL: the checkpoint holds the adapters and their optimizer state alone, the reference is the base
    (KL 0 at step 1, when the adapters add nothing), and the PEFT export on the untouched base answers as the run's
    own greedy evaluation did (so the base weights were not changed)."""
    project = rl_project / "lora"
    project.mkdir()
    for name in ("tokenizer.json", "prompts.jsonl", "held_out.jsonl"):
        (project / name).write_bytes((rl_project / name).read_bytes())
    (project / "sft").symlink_to(rl_project / "sft")
    (project / "rl.yaml").write_text(CONFIG + "lora:\n  r: 4\n  alpha: 8.0\n", encoding="utf-8")
    steps = ["--trainer.num_train_steps", "6", "--optimizer.learning_rate", "5.0e-3"]
    result = cli(["rl", "rl.yaml", "--trainer.run_dir", "runs/lora", *steps], project)
    assert result.returncode == 0, result.output[-5000:]
    assert "RL reference model: the base model (LoRA adapters off)" in result.output
    run_dir = project / "runs" / "lora"
    saved = dist_ckpt.load(run_dir / "checkpoints" / "step-4", progress=False)
    model_keys = [k for k in saved if k.startswith(".model")]
    assert model_keys and all(".lora_a" in k or ".lora_b" in k for k in model_keys), model_keys
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[0]["rl/kl"] == 0.0 and max(r["rl/kl"] for r in rows) > 0
    assert all(r["rl/logprob_mismatch"] == 0.0 for r in rows)
    evals = {r["step"]: r for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if "eval/rl/reward/mean" in r}
    adapter = run_dir / "hf" / "step-6"
    assert (adapter / "adapter_model.safetensors").is_file()
    before = greedy_accuracy(rl_project / "sft", rl_project / "held_out.jsonl")
    after = greedy_accuracy(rl_project / "sft", rl_project / "held_out.jsonl", adapter=adapter)
    print(f"LoRA RL, held-out greedy exact answers: {before}/{HELD_OUT} before, {after}/{HELD_OUT} after 6 steps")
    assert evals[6]["eval/rl/reward/exact_answer/mean"] == pytest.approx(after / HELD_OUT)
    assert after > before
