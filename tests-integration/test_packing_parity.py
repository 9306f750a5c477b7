"""Packed sequences give each document exactly the logits and loss it gets alone (Llama and GPT-2).

The packed rows come from shard_cache's packer (the code a training run reads through), the attention mask
from named_tensors, the model from lm_models with restarting positions.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lm_models
import named_tensors as nt
from shard_cache import plan_packs
from shard_cache.packing import pack_sequence

SEQ_LEN = 32
VOCAB = 61
CONFIGS = {
    "llama": lm_models.LlamaConfig(
        seq_len=SEQ_LEN, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2
    ),
    "gpt2": lm_models.Gpt2Config(seq_len=SEQ_LEN, hidden_dim=32, num_layers=2, num_heads=4),
}


def _packed_batch(docs: list[np.ndarray], masks: list[np.ndarray]):
    """Pack the documents with shard_cache's planner and assembler, as one chunk."""
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    plan, stats = plan_packs([len(d) for d in docs], SEQ_LEN)
    tokens, targets = np.concatenate(docs), np.concatenate(masks)
    rows = [pack_sequence(p, tokens, offsets, targets, SEQ_LEN) for p in plan]
    return plan, {k: np.stack([r[k] for r in rows]) for k in rows[0]}, stats


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_each_packed_document_gets_its_own_logits_and_loss(family):
    rng = np.random.default_rng(3)
    lengths = [7, 12, 5, 20, 9, 3]
    docs = [rng.integers(0, VOCAB, n).astype(np.int32) for n in lengths]
    masks = [rng.random(n) < 0.7 for n in lengths]
    plan, batch, stats = _packed_batch(docs, masks)
    assert stats.sequences == len(plan) < len(docs)  # several documents share a sequence
    model = CONFIGS[family].build(nt.Axis("vocab", VOCAB), key=jax.random.key(0))

    def named(x):
        return nt.named(jnp.asarray(x), ("batch", "position"))

    @eqx.filter_jit
    def packed_forward(m, ids, segments, positions, loss_mask):
        mask = nt.nn.packed_causal_mask(segments)
        logits = m(ids, mask, positions=positions)
        loss = lm_models.next_token_loss(
            m, ids, loss_mask=loss_mask, attn_mask=mask, positions=positions, reduction="sum"
        )
        return nt.permute(logits, ("batch", "position", "vocab")).array, loss.array

    @eqx.filter_jit
    def unpacked_forward(m, ids, loss_mask):
        logits = m(ids)
        loss = lm_models.next_token_loss(m, ids, loss_mask=loss_mask, reduction="sum")
        return nt.permute(logits, ("batch", "position", "vocab")).array, loss.array

    packed, packed_loss = packed_forward(
        model, *(named(batch[k]) for k in ("input_ids", "segment_ids", "positions", "loss_mask"))
    )
    # Each document alone: at positions 0..n-1 of its own row (the padding after it is causally invisible).
    alone_ids = np.zeros((len(docs), SEQ_LEN), np.int32)
    alone_mask = np.zeros((len(docs), SEQ_LEN), bool)
    for i, (doc, target) in enumerate(zip(docs, masks, strict=True)):
        alone_ids[i, : len(doc)] = doc
        alone_mask[i, : len(doc) - 1] = target[1:]  # predicting token t + 1 counts where it is a target
    alone, alone_loss = unpacked_forward(model, named(alone_ids), named(alone_mask))

    for row, pieces in enumerate(plan):
        at = 0
        for doc, start, stop in pieces.tolist():
            n = stop - start
            np.testing.assert_allclose(
                np.asarray(packed[row, at : at + n]), np.asarray(alone[doc, :n]), atol=1e-5, rtol=0
            )
            at += n
    np.testing.assert_allclose(float(packed_loss), float(alone_loss), rtol=1e-5)
