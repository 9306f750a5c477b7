"""An asynchronous save owns a copy of the data: the caller may change or donate its arrays right away."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import dist_ckpt


def test_caller_may_mutate_and_donate_right_after_save_returns(tmp_path):
    host = np.arange(256 * 1024, dtype=np.float32)
    device = jnp.arange(256 * 1024, dtype=jnp.float32)
    expected_device = np.asarray(device).copy()

    @partial(jax.jit, donate_argnums=0)
    def train_step(x):
        return x * 2.0 + 1.0

    dist_ckpt.save({"host": host, "device": device}, tmp_path / "ck", step=1)
    host[:] = -1.0  # the next step overwrites host state in place
    device = train_step(device)  # ...and donates the device buffer that was saved
    jax.block_until_ready(device)
    dist_ckpt.wait()

    loaded = dist_ckpt.load(tmp_path / "ck")
    assert loaded["['host']"].tobytes() == np.arange(256 * 1024, dtype=np.float32).tobytes()
    assert loaded["['device']"].tobytes() == expected_device.tobytes()


def test_the_next_save_waits_for_the_previous_one(tmp_path):
    first = dist_ckpt.save({"w": np.ones(1024, np.float32)}, tmp_path / "step-1", step=1)
    second = dist_ckpt.save({"w": np.zeros(1024, np.float32)}, tmp_path / "step-2", step=2)
    assert first.done()  # one save in flight at a time: bounded host memory, ordered commits
    second.wait()
    assert [info.step for info in dist_ckpt.list_checkpoints(tmp_path) if info.committed] == [1, 2]
