"""Packed rows' attention from their segment ids against the same rows given the whole mask, per kernel.

Prints one JSON line per kernel, `packed_attention.<kernel>`. A tiny Llama's next-token loss and gradient
(jitted) over rows that each pack `--documents` documents of equal length, positions restarting, in two forms:
- segment ids: `attn_mask=nt.nn.AttentionMask.packed(ids)`, what lm-train's step gives the model; ours blockwise
  (`jax_flash`) and the splash kernel take the ids and never build the (batch, position, key_position) mask;
- the whole mask (the reference): `nt.nn.packed_causal_mask(ids)`, one boolean array, which lm-train gave before.
Both are compiled; `*_bytes` are XLA's `memory_analysis()` (temporaries plus arguments), and the step times are
alternated over `--repeats` rounds. ratio = segment-ids tokens/s / whole-mask tokens/s; `memory_ratio` likewise
for bytes (below 1: less memory); `same_loss` checks the two forms compute one loss.
Run: `uv run python bench/packed_attention.py [--seq-len 4096] [--batch 4] [--kernels jax_flash vanilla]`.
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from common import emit, log, median, time_call

import lm_models as lm
import named_tensors as nt
from lm_train.run.host_memory import restart_with_hugepage_malloc


def packed_inputs(
    batch: int, seq_len: int, documents: int, vocab: int
) -> tuple[nt.NamedArray, nt.NamedArray, nt.NamedArray]:
    """(token ids, segment ids, positions restarting per document), each (batch, position)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (batch, seq_len))
    segments = np.repeat(np.arange(documents), -(-seq_len // documents))[:seq_len]
    positions = np.arange(seq_len) - np.searchsorted(segments, segments)  # each document's first index
    axes = ("batch", "position")
    return tuple(
        nt.named(jnp.asarray(np.broadcast_to(a, (batch, seq_len)), jnp.int32), axes) for a in (ids, segments, positions)
    )


def measure(kernel: str, args: argparse.Namespace) -> None:
    config = lm.LlamaConfig(
        seq_len=args.seq_len, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
        attn_backend=kernel, flash_attention_block_size=512,
    )  # fmt: skip
    model = config.build(nt.Axis("vocab", args.vocab), key=jax.random.key(0))
    ids, segments, positions = packed_inputs(args.batch, args.seq_len, args.documents, args.vocab)
    masks = {"segment_ids": nt.nn.AttentionMask.packed(segments), "whole_mask": nt.nn.packed_causal_mask(segments)}
    step = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m, mask: lm.next_token_loss(m, ids, attn_mask=mask, positions=positions).array)
    )
    memory, losses, times = {}, {}, {name: [] for name in masks}
    for name, mask in masks.items():
        analysis = step.lower(model, mask).compile().compiled.memory_analysis()
        memory[name] = analysis.temp_size_in_bytes + analysis.argument_size_in_bytes
        losses[name] = float(jax.block_until_ready(step(model, mask))[0])
    for r in range(args.repeats):
        for name in masks if r % 2 == 0 else reversed(masks):
            times[name].append(time_call(lambda mask=masks[name]: jax.block_until_ready(step(model, mask)))[0])
    tokens = args.batch * args.seq_len
    tps = {name: tokens / median(t) for name, t in times.items()}
    log(f"packed_attention[{kernel}]: bytes {memory}, seconds {times}, losses {losses}")
    emit(
        f"packed_attention.{kernel}",
        {
            "segment_ids_tokens_per_s": round(tps["segment_ids"], 1),
            "whole_mask_tokens_per_s": round(tps["whole_mask"], 1),
            "segment_ids_bytes": memory["segment_ids"],
            "whole_mask_bytes": memory["whole_mask"],
            "memory_ratio": round(memory["segment_ids"] / memory["whole_mask"], 4),
            "same_loss": bool(np.isclose(losses["segment_ids"], losses["whole_mask"], rtol=1e-5)),
            "seq_len": args.seq_len,
            "batch": args.batch,
            "documents": args.documents,
        },
        reference="whole_mask_tokens_per_s",
        ratio=tps["segment_ids"] / tps["whole_mask"],
        ratio_means="tokens/s with segment ids / tokens/s with the whole mask (same rows, loss and gradient)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--documents", type=int, default=8, help="documents packed in each row")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--kernels", nargs="+", default=["jax_flash"], choices=["jax_flash", "vanilla", "splash"])
    args = parser.parse_args()
    for kernel in args.kernels:
        measure(kernel, args)


if __name__ == "__main__":
    restart_with_hugepage_malloc()  # as `lm-train` starts: the step's buffers on huge pages
    main()
