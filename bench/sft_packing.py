"""Tokens/s of packed SFT against padded SFT: the lm-train train step over the same conversations, both ways.

Prints one JSON line, `sft_packing`. The conversations are the built-in corpus's synthetic chats
(lm_train.data.corpus_chats), rendered with a ChatML-style template by shard-cache's ChatProcessor (a BPE
trained here on them), with the loss on the assistant's turns. Then, in this run:
- padded (the reference): one conversation per row, padded to seq_len (`data.pack: false`: input_ids and
  loss_mask, a plain causal mask), as shard-cache's packing rule gives it with one segment per sequence;
- packed: several whole conversations per row (`data.pack: true`: segment ids, restarting positions), first-fit
  decreasing as shard-cache packs a chunk.
Both take the same conversations (longer ones truncated to seq_len) through the train step of a tiny Llama
(lm_train.run.state.init_state + lm_train.run.step.make_train_step, jitted with donation as the trainer does), one
pass each after compilation, timed in alternation over `--repeats` rounds. Tokens/s counts the conversations'
tokens (no padding), so ratio = packed tokens/s / padded tokens/s is the speedup packing gives; `fill_*` is
the share of each row that holds tokens.
Run: `uv run python bench/sft_packing.py [--conversations 512] [--seq-len 256] [--batch 16]`.
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import numpy as np
from common import emit, log

import lm_models
import named_tensors as nt
from lm_train.config import AdamConfig, TrainerConfig, TrainLmConfig
from lm_train.data.corpus_chats import conversations
from lm_train.optim import build_optimizer
from lm_train.run.batch import as_host_batch, named_batch
from lm_train.run.mesh import check_batch_fits, plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_state
from lm_train.run.step import StepSettings, make_train_step

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def tokenized(count: int, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat tokens, document offsets, per-token targets) of `count` chats, as a cache chunk holds them."""
    from shard_cache import ChatProcessor, train_tokenizer

    records = [record for _, (_, record) in zip(range(count), conversations(), strict=False)]
    texts = [m["content"] for r in records for m in r["messages"]]
    tokenizer = train_tokenizer(texts, vocab)
    processor = ChatProcessor(tokenizer, chat_template=TEMPLATE, special_tokens={"eos_token": "<|endoftext|>"})
    batch = processor([processor.prepare(r) for r in records]).to_pydict()
    lengths = [len(ids) for ids in batch["input_ids"]]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate([np.asarray(ids, np.int32) for ids in batch["input_ids"]])
    targets = np.concatenate([np.asarray(mask, bool) for mask in batch["loss_mask"]])
    return tokens, offsets, targets


def rows(tokens, offsets, targets, seq_len: int, packed: bool) -> tuple[dict[str, np.ndarray], int]:
    """Every row of the pass (packed or one conversation each) and the conversations' tokens they hold."""
    from shard_cache import plan_packs
    from shard_cache.packing import pack_sequence

    plan, stats = plan_packs(np.diff(offsets), seq_len, long_documents="truncate", max_segments=None if packed else 1)
    built = [pack_sequence(p, tokens, offsets, targets, seq_len) for p in plan]
    fields = ("input_ids", "segment_ids", "positions", "loss_mask") if packed else ("input_ids", "loss_mask")
    return {k: np.stack([r[k] for r in built]) for k in fields}, stats.tokens


class Step:
    """The lm-train train step of a tiny Llama, set up as lm_train.run.loop does."""

    def __init__(self, seq_len: int, batch: int, vocab: int) -> None:
        model = lm_models.LlamaConfig(
            seq_len=seq_len, hidden_dim=128, intermediate_dim=352, num_layers=4, num_heads=4, num_kv_heads=2,
            gradient_checkpointing=False,
        )  # fmt: skip
        trainer = TrainerConfig(train_batch_size=batch, mp="f32", num_train_steps=10_000)
        config = TrainLmConfig(model=model, trainer=trainer, optimizer=AdamConfig(learning_rate=1e-3, warmup=0.0))
        self.plan, self.Pos, self.batch_size = plan_mesh(trainer), model.Pos, batch
        optimizer, schedule = build_optimizer(config.optimizer, trainer.num_train_steps)
        self.state = init_state(config, self.plan, nt.Axis("vocab", vocab), optimizer)
        settings = StepSettings(parse_policy("f32"), check_batch_fits(trainer, self.plan, 1), 0.0)
        self.fn = eqx.filter_jit(make_train_step(optimizer, settings, schedule), donate="all")

    def run(self, data: dict[str, np.ndarray]) -> float:
        """One pass over `data` in batches (a last partial batch left out); returns the seconds it took."""
        start = time.perf_counter()
        with self.plan.mesh, nt.axis_mapping(self.plan.compute_mapping, mesh=self.plan.mesh):
            for b in range(len(data["input_ids"]) // self.batch_size):
                local = {k: v[b * self.batch_size : (b + 1) * self.batch_size] for k, v in data.items()}
                arrays = {
                    k: jax.make_array_from_process_local_data(self.plan.batch_sharding(), v)
                    for k, v in as_host_batch(local).items()
                }
                self.state, _ = self.fn(self.state, named_batch(arrays, "batch", self.Pos))
            jax.block_until_ready(self.state)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    tokens, offsets, targets = tokenized(args.conversations, args.vocab)
    packed, packed_tokens = rows(tokens, offsets, targets, args.seq_len, packed=True)
    padded, padded_tokens = rows(tokens, offsets, targets, args.seq_len, packed=False)
    n_packed = len(packed["input_ids"]) // args.batch * args.batch
    n_padded = len(padded["input_ids"]) // args.batch * args.batch
    fill_packed = packed_tokens / (len(packed["input_ids"]) * args.seq_len)
    fill_padded = padded_tokens / (len(padded["input_ids"]) * args.seq_len)
    # Tokens per pass: those of the full batches (each pass drops its last partial batch).
    per_packed = packed_tokens * n_packed / len(packed["input_ids"])
    per_padded = padded_tokens * n_padded / len(padded["input_ids"])
    log(f"{len(offsets) - 1} conversations: {len(packed['input_ids'])} packed rows, {len(padded['input_ids'])} padded")
    vocab = args.vocab + 8
    steps = {"packed": Step(args.seq_len, args.batch, vocab), "padded": Step(args.seq_len, args.batch, vocab)}
    data = {"packed": packed, "padded": padded}
    for name in steps:  # compile (and warm) each on one batch
        steps[name].run({k: v[: args.batch] for k, v in data[name].items()})
    times: dict[str, list[float]] = {"packed": [], "padded": []}
    for r in range(args.repeats):
        for name in ("packed", "padded") if r % 2 == 0 else ("padded", "packed"):
            times[name].append(steps[name].run(data[name]))
    packed_tps = per_packed * len(times["packed"]) / sum(times["packed"])
    padded_tps = per_padded * len(times["padded"]) / sum(times["padded"])
    emit(
        "sft_packing",
        {
            "packed_tokens_per_s": round(packed_tps, 1),
            "padded_tokens_per_s": round(padded_tps, 1),
            "packed_rows": len(packed["input_ids"]),
            "padded_rows": len(padded["input_ids"]),
            "fill_packed": round(fill_packed, 3),
            "fill_padded": round(fill_padded, 3),
            "conversations": len(offsets) - 1,
            "seq_len": args.seq_len,
            "batch": args.batch,
        },
        reference="padded_tokens_per_s",
        ratio=packed_tps / padded_tps,
    )


if __name__ == "__main__":
    main()
