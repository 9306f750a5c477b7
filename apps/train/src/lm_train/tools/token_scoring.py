"""The log-prob of every next token under a model: one jitted function on the run's mesh, over fixed batches.

Used by `lm-train viz` (a page of shaded tokens) and by the lm-eval adapter (log-likelihoods). A sequence of
n <= seq_len + 1 ids is scored as the input ids[:-1] against the targets ids[1:], right-padded to seq_len, so
one program is compiled whatever the lengths; causality keeps the padding from changing the real scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp
import numpy as np
from jax.experimental import multihost_utils

import named_tensors as nt
from lm_models import inference_mode
from lm_train.run.mesh import MeshPlan


def next_token_scores(
    model: Any, input_ids: nt.NamedArray, targets: jax.Array, policy: jmp.Policy
) -> tuple[jax.Array, jax.Array]:
    """log p(targets[b, t] | input_ids[b, ..t]) and whether targets[b, t] is the argmax, at every position."""
    model = policy.cast_to_compute(inference_mode(model))
    logits = model(nt.shard(input_ids))
    logits = nt.permute(logits, (input_ids.axes[0], "position", model.Vocab.name)).array.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return chosen, jnp.argmax(logits, axis=-1) == targets


class TokenScorer:
    """Scores rows of token ids in batches of `batch_size` rows of `seq_len` positions, on the plan's mesh.

    Every process must call `score` with the same rows (the batch is built from them on each process).
    """

    def __init__(
        self,
        model: Any,
        plan: MeshPlan,
        policy: jmp.Policy,
        seq_len: int,
        batch_size: int,
        *,
        batch_axis: str = "batch",
        pad_id: int = 0,
    ):
        self.model = model
        self.plan = plan
        self.seq_len = seq_len
        # Whole rows per data-parallel device: round up to a multiple of the data axis.
        self.batch_size = -(-max(batch_size, 1) // plan.data_size) * plan.data_size
        self.batch_axis = batch_axis
        self.pad_id = pad_id
        self._step = eqx.filter_jit(lambda m, ids, targets: next_token_scores(m, ids, targets, policy))

    def _scores_of_batch(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sharding = self.plan.batch_sharding()
        array = jax.make_array_from_callback(inputs.shape, sharding, lambda index: inputs[index])
        target_array = jax.make_array_from_callback(targets.shape, sharding, lambda index: targets[index])
        ids = nt.NamedArray(array, (nt.Axis(self.batch_axis, inputs.shape[0]), nt.Axis("position", self.seq_len)))
        with nt.axis_mapping(self.plan.compute_mapping, mesh=self.plan.mesh):
            log_probs, is_argmax = self._step(self.model, ids, target_array)
        if jax.process_count() > 1:  # rows of other processes' devices come over the network
            log_probs, is_argmax = multihost_utils.process_allgather((log_probs, is_argmax), tiled=True)
        return np.asarray(log_probs), np.asarray(is_argmax)

    def score(self, sequences: Sequence[Sequence[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each sequence of at most seq_len + 1 ids: the log-probs and argmax flags of its ids 1..n-1, each
        given the ids before it."""
        results: list[tuple[np.ndarray, np.ndarray]] = []
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            inputs = np.full((self.batch_size, self.seq_len), self.pad_id, np.int32)
            targets = np.full((self.batch_size, self.seq_len), self.pad_id, np.int32)
            for i, seq in enumerate(chunk):
                if len(seq) > self.seq_len + 1:
                    raise ValueError(f"a sequence of {len(seq)} ids does not fit seq_len={self.seq_len} (+1)")
                inputs[i, : len(seq) - 1] = seq[:-1]
                targets[i, : len(seq) - 1] = seq[1:]
            log_probs, is_argmax = self._scores_of_batch(inputs, targets)
            for i, seq in enumerate(chunk):
                n = max(len(seq) - 1, 0)
                results.append((log_probs[i, :n].copy(), is_argmax[i, :n].copy()))
        return results


def scorer_for(model: Any, config: Any, plan: MeshPlan, batch_size: int | None = None) -> TokenScorer:
    """A TokenScorer for a run's model, its precision policy and seq_len (default batch: the eval batch)."""
    from lm_train.run.evaluation import eval_batch_size
    from lm_train.run.precision import parse_policy

    size = batch_size if batch_size is not None else eval_batch_size(config, plan)
    return TokenScorer(
        model, plan, parse_policy(config.trainer.mp), config.model.Pos.size, size, batch_axis=config.trainer.batch_axis
    )
