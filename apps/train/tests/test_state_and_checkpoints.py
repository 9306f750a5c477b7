"""The state's shapes and init, and finding, restoring and model-only loading of checkpoints (real dist-ckpt)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

import dist_ckpt
import named_tensors as nt
from lm_train.errors import CheckpointError
from lm_train.optim import build_optimizer
from lm_train.run.checkpoints import (
    committed_checkpoint,
    find_resume_checkpoint,
    load_model_weights,
    resolve_checkpoint,
    restore_newest_intact,
    restore_state,
)
from lm_train.run.mesh import plan_mesh
from lm_train.run.run_dir import RunPaths
from lm_train.run.state import PURPOSE_DROPOUT, init_state, model_shapes, state_shapes, step_key

Vocab = nt.Axis("vocab", 64)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny state saved as step-3 (complete) beside a torn step-5 (no commit marker)."""
    from lm_train.config import load_train_config

    root = tmp_path_factory.mktemp("run")
    tiny = ["--model.hidden_dim", "32", "--model.num_layers", "2", "--model.num_heads", "2", "--model.seq_len", "16"]
    config, _ = load_train_config(
        [Path(__file__).parents[3] / "configs" / "gpt2_nano.yaml"],
        [*tiny, "--trainer.train_batch_size", "8", "--trainer.run_dir", str(root)],
    )
    plan = plan_mesh(config.trainer)
    optimizer, _ = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    state = init_state(config, plan, Vocab, optimizer)
    paths = RunPaths.for_config(config)
    dist_ckpt.save(state, paths.checkpoints / "step-3", step=3, block=True, progress=False)
    (paths.checkpoints / "step-5" / "arrays").mkdir(parents=True)  # a save that never committed
    return config, plan, optimizer, state, paths


def test_shapes_and_init_agree_on_structure_and_layout(saved):
    config, plan, optimizer, state, _ = saved
    target = state_shapes(config, plan, Vocab, optimizer)
    for leaf, shape in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
        assert leaf.shape == shape.shape and leaf.dtype == shape.dtype and leaf.sharding == shape.sharding
    model_target = model_shapes(config, plan, Vocab)
    assert jax.tree.structure(model_target) == jax.tree.structure(target.model)
    # Parameters are spread over the devices (FSDP over embed), not copied whole to each.
    embed = state.model.token_embeddings.weight.array
    assert len({s.device for s in embed.addressable_shards}) == 8


def test_step_keys_are_a_pure_function_of_step_and_purpose(saved):
    key = saved[3].key
    a, b = step_key(key, 4, PURPOSE_DROPOUT), step_key(key, 4, PURPOSE_DROPOUT)
    assert np.array_equal(jax.random.key_data(a), jax.random.key_data(b))
    assert not np.array_equal(jax.random.key_data(a), jax.random.key_data(step_key(key, 5, PURPOSE_DROPOUT)))


def test_only_committed_checkpoints_are_found(saved):
    _, _, _, _, paths = saved
    step3 = paths.checkpoints / "step-3"
    assert committed_checkpoint(step3) == step3
    assert committed_checkpoint(paths.checkpoints / "step-5") is None  # torn: never loaded
    assert committed_checkpoint(paths.checkpoints) == step3
    assert resolve_checkpoint(paths.run_dir) == step3  # a run directory works too
    with pytest.raises(CheckpointError, match="No complete checkpoint"):
        resolve_checkpoint(paths.checkpoints / "step-5")


def _with(obj, **changes):
    return dataclasses.replace(obj, **changes)


def test_resume_rules(saved, tmp_path):
    config, _, _, _, paths = saved
    found = paths.checkpoints / "step-3"
    assert find_resume_checkpoint(config, paths) == found
    fresh = RunPaths(tmp_path / "fresh")
    assert find_resume_checkpoint(config, fresh) is None
    with pytest.raises(CheckpointError, match="load_checkpoint is true"):
        find_resume_checkpoint(_with(config, trainer=_with(config.trainer, load_checkpoint=True)), fresh)
    assert find_resume_checkpoint(_with(config, trainer=_with(config.trainer, load_checkpoint=False)), paths) is None
    elsewhere = _with(config.trainer, load_checkpoint_path=str(paths.checkpoints))
    assert find_resume_checkpoint(_with(config, trainer=elsewhere), fresh) == found
    # trainer.checkpointer.base_path is where the run both saves and resumes.
    moved = _with(config.trainer, checkpointer=_with(config.trainer.checkpointer, base_path=str(paths.checkpoints)))
    assert find_resume_checkpoint(_with(config, trainer=moved), fresh) == found


def test_restore_and_model_only_load_give_back_the_saved_arrays(saved):
    config, plan, optimizer, state, paths = saved
    step3 = paths.checkpoints / "step-3"
    restored = restore_state(step3, state_shapes(config, plan, Vocab, optimizer))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model, step = load_model_weights(step3, config, plan, Vocab)
    assert step == 3
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(state.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wider = _with(config, model=_with(config.model, hidden_dim=64))
    with pytest.raises(CheckpointError, match="does not fit"):
        load_model_weights(step3, wider, plan, Vocab)


def _flip_a_byte_in_an_array(checkpoint: Path) -> Path:
    """Flip one bit in the middle of the largest array chunk (a bit flip, not a truncation)."""
    chunk = max(
        (p for p in (checkpoint / "arrays").rglob("*") if p.is_file() and "zarr" not in p.name),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    return chunk


def test_a_damaged_newest_checkpoint_is_quarantined_and_the_previous_one_resumed(saved, tmp_path):
    config, plan, optimizer, state, _ = saved
    run = _with(config, trainer=_with(config.trainer, run_dir=str(tmp_path / "run")))
    paths = RunPaths.for_config(run)
    for step in (2, 4):
        dist_ckpt.save(state, paths.checkpoints / f"step-{step}", step=step, block=True, progress=False)
    _flip_a_byte_in_an_array(paths.checkpoints / "step-4")
    target = state_shapes(config, plan, Vocab, optimizer)
    newest = find_resume_checkpoint(run, paths)
    assert newest == paths.checkpoints / "step-4"

    # Named by the user, a damaged checkpoint is an error, and nothing is renamed.
    named = _with(run, trainer=_with(run.trainer, load_checkpoint_path=str(newest)))
    with pytest.raises(CheckpointError, match=r"trainer\.load_checkpoint_path: .*step-4"):
        restore_newest_intact(newest, target, named, paths, is_main=True)
    assert newest.is_dir()

    with pytest.warns(UserWarning, match=r"Quarantined it as .*step-4\.corrupt"):
        restored, used = restore_newest_intact(newest, target, run, paths, is_main=True)
    assert used == paths.checkpoints / "step-2"
    assert not newest.exists() and (paths.checkpoints / "step-4.corrupt").is_dir()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert find_resume_checkpoint(run, paths) == paths.checkpoints / "step-2"

    # With every checkpoint damaged the run stops rather than restarting from step 0.
    _flip_a_byte_in_an_array(paths.checkpoints / "step-2")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="silently restart from step 0"):
        restore_newest_intact(paths.checkpoints / "step-2", target, run, paths, is_main=True)
    assert find_resume_checkpoint(run, paths) is None


def test_a_llama_checkpoint_of_lm_models_before_0_8_still_restores(tmp_path):
    """Llama's block norms were `input_layernorm`/`post_attention_layernorm` before it became a decoder spec; a
    checkpoint written under those names restores onto today's tree, every array equal."""
    import json

    import crc32c

    from lm_train.config import load_train_config

    tiny = ["--model.hidden_dim", "32", "--model.num_layers", "2", "--model.num_heads", "2", "--model.seq_len", "16"]
    config, _ = load_train_config(
        [Path(__file__).parents[3] / "configs" / "llama_nano.yaml"],
        [*tiny, "--trainer.train_batch_size", "8", "--trainer.run_dir", str(tmp_path / "run")],
    )
    plan = plan_mesh(config.trainer)
    optimizer, _ = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    state = init_state(config, plan, Vocab, optimizer)
    paths = RunPaths.for_config(config)
    dist_ckpt.save(state, paths.checkpoints / "step-2", step=2, block=True, progress=False)
    manifest_file = paths.checkpoints / "step-2" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    old_names = {".pre_attn_norm.": ".input_layernorm.", ".pre_mlp_norm.": ".post_attention_layernorm."}
    for leaf in manifest["leaves"]:
        for new, old in old_names.items():
            leaf["path"] = leaf["path"].replace(new, old)
    assert any("input_layernorm" in leaf["path"] for leaf in manifest["leaves"])
    written = json.dumps(manifest).encode()
    manifest_file.write_bytes(written)  # as the older lm-train wrote it, commit marker and all
    marker = paths.checkpoints / "step-2" / "COMMITTED"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "manifest_crc32c": crc32c.crc32c(written)}))

    target = state_shapes(config, plan, Vocab, optimizer)
    restored, _ = restore_newest_intact(paths.checkpoints / "step-2", target, config, paths, is_main=True)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model, _ = load_model_weights(paths.checkpoints / "step-2", config, plan, Vocab)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(state.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
