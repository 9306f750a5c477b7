"""The starting state (fresh, or resumed from a real checkpoint) and the run directory's files; sample's checks."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import dist_ckpt
import shard_cache
from lm_train.config import load_train_config
from lm_train.data.caches import PreparedData
from lm_train.errors import UserError
from lm_train.run.distributed import DistributedInfo
from lm_train.run.preflight import prepare_run
from lm_train.run.start import starting_state, write_run_dir
from lm_train.tools.generate_text import check_sampling_options

TEXTS = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n"] * 30


def test_fresh_then_resumed_state_and_the_run_directory(make_config, tmp_path):
    tokenizer = tmp_path / "tok.json"
    shard_cache.train_tokenizer(TEXTS, 280, save_path=tokenizer)
    data = PreparedData(str(tokenizer), "unused", None, [])
    config = make_config("--trainer.run_dir", str(tmp_path / "run"))
    one = DistributedInfo(0, 1, "test")

    setup = prepare_run(config, one)
    state, target = starting_state(setup, data)
    assert int(state.step) == 0 and setup.resume_from is None
    vocab = shard_cache.load_tokenizer(str(tokenizer)).get_vocab_size(with_added_tokens=True)
    assert state.model.token_embeddings.weight.array.shape[0] == vocab  # the vocabulary is the tokenizer's
    write_run_dir(setup, data)
    paths = setup.paths
    assert paths.tokenizer_file.read_bytes() == tokenizer.read_bytes()
    reread, _ = load_train_config([paths.config_file])
    assert reread == setup.config  # the run directory alone describes the run, as decided for these devices
    assert setup.config.model.scan_unroll is True and config.model.scan_unroll == "auto"

    dist_ckpt.save(state, paths.checkpoints / "step-0", step=0, block=True, progress=False)
    again = prepare_run(config, one)
    assert again.resume_from == paths.checkpoints / "step-0"
    resumed, _ = starting_state(again, data)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(target) == jax.tree.structure(resumed)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ((0, 1.0, None, None), "--max-new-tokens must be at least 1"),
        ((8, -0.5, None, None), "--temperature must be >= 0"),
        ((8, 1.0, 0, None), "--top-k must be at least 1"),
        ((8, 1.0, None, 1.5), r"--top-p must be in \(0, 1\]"),
        ((8, 1.0, None, 0.0), r"--top-p must be in \(0, 1\]"),
    ],
)
def test_sampling_options_are_checked_without_a_model(options, message):
    with pytest.raises(UserError, match=message):
        check_sampling_options(*options)
    check_sampling_options(8, 0.0, 5, 1.0)  # greedy, top-k and top-p 1 are fine
