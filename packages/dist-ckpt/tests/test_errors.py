"""Bad input gets a clear error naming the key path or file, and nothing already written is harmed."""

import json

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dist_ckpt


@pytest.fixture
def saved(tmp_path):
    tree = {"params": {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros(3)}, "step": 4}
    dist_ckpt.save(tree, tmp_path / "step-4", step=4, block=True)
    return tmp_path / "step-4", tree


def test_missing_leaf_in_target_names_the_key_path(saved):
    path, _ = saved
    with pytest.raises(dist_ckpt.TreeMismatchError, match=r"checkpoint has leaf \['params'\]\['b'\]"):
        dist_ckpt.load(path, {"params": {"w": np.zeros((2, 3), np.float32)}, "step": 0})


def test_extra_leaf_in_target_names_the_key_path(saved):
    path, _ = saved
    target = {"params": {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}, "step": 0, "lr": 0.1}
    with pytest.raises(dist_ckpt.TreeMismatchError, match=r"target has leaf \['lr'\]"):
        dist_ckpt.load(path, target)


def test_shape_mismatch_names_the_leaf_and_both_shapes(saved):
    path, _ = saved
    target = {"params": {"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32)}, "step": 0}
    with pytest.raises(dist_ckpt.TreeMismatchError, match=r"\['params'\]\['w'\].*\(2, 3\).*\(3, 2\)"):
        dist_ckpt.load(path, target)


def test_subtree_prefix_stops_at_a_key_boundary(tmp_path):
    dist_ckpt.save({"param": 1, "params": {"w": 2}}, tmp_path / "ck", step=0, block=True)
    assert dist_ckpt.load(tmp_path / "ck", subtree="['param']") == {"['param']": 1}
    assert dist_ckpt.load(tmp_path / "ck", {"w": 0}, subtree="['params']") == {"w": 2}


def test_unknown_subtree_lists_the_top_level_keys(saved):
    path, _ = saved
    with pytest.raises(dist_ckpt.TreeMismatchError, match=r"subtree \"\['opt'\]\".*\['params'\]"):
        dist_ckpt.load(path, {}, subtree="['opt']")


def test_unsupported_leaf_names_its_path_and_writes_nothing(tmp_path):
    with pytest.raises(TypeError, match=r"Leaf \['cfg'\]\['fn'\] has type object, which dist_ckpt cannot save"):
        dist_ckpt.save({"cfg": {"fn": object()}}, tmp_path / "ck", step=0)
    assert not (tmp_path / "ck").exists()


def test_typed_prng_key_asks_for_key_data(tmp_path):
    with pytest.raises(TypeError, match=r"\['key'\].*jax.random.key_data"):
        dist_ckpt.save({"key": jax.random.key(0)}, tmp_path / "ck", step=0)


def test_non_json_metadata_is_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match=r"metadata for checkpoint .*ck must be JSON-serializable"):
        dist_ckpt.save({"x": 1}, tmp_path / "ck", step=0, metadata={"lr": object()})
    assert not (tmp_path / "ck").exists()


def test_saving_over_a_complete_checkpoint_is_refused_and_it_stays_intact(saved):
    path, tree = saved
    with pytest.raises(dist_ckpt.CheckpointExistsError, match="step-4 already exists and is complete"):
        dist_ckpt.save({"other": jnp.ones(2)}, path, step=4)
    loaded = dist_ckpt.load(path, jax.tree.map(np.zeros_like, tree))
    np.testing.assert_array_equal(loaded["params"]["w"], np.arange(6.0, dtype=np.float32).reshape(2, 3))


def test_saving_onto_a_file_is_refused_and_the_file_kept(tmp_path):
    (tmp_path / "step-1").write_text("notes")
    with pytest.raises(dist_ckpt.CheckpointExistsError, match=r"step-1: a file \(not a checkpoint directory\)"):
        dist_ckpt.save({"x": 1}, tmp_path / "step-1", step=1)
    assert (tmp_path / "step-1").read_text() == "notes"


def test_a_checkpoint_directory_that_cannot_be_made_is_a_storage_error(tmp_path):
    (tmp_path / "notes").write_text("notes")  # a file where the root's directory should be
    with pytest.raises(dist_ckpt.StorageError, match=r"Could not create .*notes/step-1: .*Not a directory") as caught:
        dist_ckpt.save({"x": 1}, tmp_path / "notes" / "step-1", step=1)
    assert caught.value.url == str(tmp_path / "notes" / "step-1") and caught.value.reason == "other"
    assert (tmp_path / "notes").read_text() == "notes"


def test_loading_a_torn_checkpoint_is_refused(saved):
    path, tree = saved
    (path / "COMMITTED").unlink()
    with pytest.raises(dist_ckpt.CheckpointError, match="step-4 has no commit marker"):
        dist_ckpt.load(path, tree)


def test_loading_a_missing_directory_says_how_to_find_one(tmp_path):
    with pytest.raises(dist_ckpt.CheckpointNotFoundError, match=r"No checkpoint directory at .*nope.*latest"):
        dist_ckpt.load(tmp_path / "nope")


def test_manifest_of_a_newer_format_is_refused(saved):
    path, _ = saved
    manifest = json.loads((path / "manifest.json").read_text())
    newer = json.dumps({**manifest, "version": 99}).encode()
    (path / "manifest.json").write_bytes(newer)
    commit = json.loads((path / "COMMITTED").read_text())  # as a newer writer would commit it
    (path / "COMMITTED").write_text(json.dumps({**commit, "manifest_crc32c": crc32c.crc32c(newer)}))
    with pytest.raises(dist_ckpt.CheckpointError, match=r"version 99.*Upgrade dist-ckpt"):
        dist_ckpt.load(path)


def test_background_write_failure_surfaces_at_the_next_call(start_worker, tmp_path):
    proc = start_worker("write_failure.py", str(tmp_path))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    # The failing write did not raise in on_step (it is async) but in the next on_step, which saves nothing.
    assert report["save_returned"] is True and "saved_at_3" not in report
    assert report["next_call_error"].startswith("BackgroundSaveError: The background save of checkpoint ")
    assert "step-2 (step 2) failed" in report["next_call_error"]
    assert report["wait_after_error"] == "ok"  # raised once, not again at every later call
    assert not (tmp_path / "step-2" / "COMMITTED").exists()
    states = [(info.step, info.committed) for info in dist_ckpt.list_checkpoints(tmp_path)]
    assert states == [(1, True), (2, False), (3, True)]  # saving works again once the cause is gone
    loaded = dist_ckpt.load(tmp_path / "step-1", {"w": np.zeros(4, np.float32)})
    np.testing.assert_array_equal(loaded["w"], np.arange(4, dtype=np.float32))
