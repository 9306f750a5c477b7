"""Context parallelism in lm-train: its config checks (before anything compiles) and the load balance of a batch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from lm_train.errors import ConfigError
from lm_train.run.batch import TokenBatch
from lm_train.run.context_parallel import balanced_order, load_balanced
from lm_train.run.distributed import DistributedInfo
from lm_train.run.preflight import prepare_run

ONE = DistributedInfo(0, 1, "test")
# 16 positions on a ring of 4: chunks of 2, device i holding chunks i and 7-i.
ORDER_16_ON_4 = [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]


def test_a_context_parallel_run_is_decided_with_its_mesh_and_step(make_config):
    setup = prepare_run(make_config("--trainer.context_axis_size", "4"), ONE)
    assert dict(setup.plan.mesh.shape) == {"replica": 1, "stage": 1, "data": 2, "context": 4, "expert": 1, "model": 1}
    assert setup.step_settings.context_size == 4
    assert prepare_run(make_config(), ONE).step_settings.context_size == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.seq_len", "100"], r"model\.seq_len=100 is not a multiple of 8"),
        (["--fcm_prob", "0.1"], "forgetful causal masking"),
        (["--model.attn_pdrop", "0.1"], "no attention dropout"),
        (["--model.type", "mpt"], "model.type mpt has no ring attention"),
        (["--trainer.model_axis_size", "4"], r"context_axis_size=4 x trainer\.model_axis_size=4 = 16 does not divide"),
    ],
)
def test_a_context_parallel_run_that_cannot_work_is_refused_before_compiling(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        prepare_run(make_config("--trainer.context_axis_size", "4", *overrides), ONE)


def test_the_load_balance_reorders_every_token_field_and_keeps_each_tokens_target():
    assert balanced_order(16, 4).tolist() == ORDER_16_ON_4
    ids = np.arange(32, dtype=np.int32).reshape(2, 16) * 3
    mask = np.ones((2, 16), bool)
    mask[1, :5] = False  # a prompt that SFT does not score
    segments = np.array([[0] * 9 + [1] * 7, [0] * 16], np.int32)
    Batch, Pos = nt.Axis("batch", 2), nt.Axis("position", 16)

    def named(x):
        return nt.named(jnp.asarray(x), (Batch, Pos))

    out = load_balanced(TokenBatch(named(ids), loss_mask=named(mask), segment_ids=named(segments)), 4)
    order = np.array(ORDER_16_ON_4)
    np.testing.assert_array_equal(out.input_ids.array, ids[:, order])
    np.testing.assert_array_equal(out.segment_ids.array, segments[:, order])
    np.testing.assert_array_equal(out.positions.array, np.tile(order, (2, 1)))
    # Position t predicts the id at t + 1; the last position predicts nothing, and the unscored prompt stays so.
    targets = np.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
    scored = mask & (np.arange(16) < 15)
    np.testing.assert_array_equal(out.targets.array, targets[:, order])
    np.testing.assert_array_equal(out.loss_mask.array, scored[:, order])
