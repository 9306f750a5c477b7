import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from shard_cache import (
    CacheLockedError,
    ShardCacheError,
    TokenizerProcessor,
    build_cache,
    open_cache,
    start_build,
    verify_cache,
)


def slow_processor(tokenizer_path, delay: float) -> TokenizerProcessor:
    """The tokenizer processor with a sleep per chunk (defined here, so Ray ships the class by value)."""

    class SlowTokenizerProcessor(TokenizerProcessor):
        def __call__(self, docs):
            time.sleep(delay)
            return super().__call__(docs)

    return SlowTokenizerProcessor(str(tokenizer_path))


@pytest.fixture
def two_shards(tmp_path, tools):
    shard_docs = [tools.make_docs(40, seed=10), tools.make_docs(30, seed=11)]
    for s, docs in enumerate(shard_docs):
        tools.write_jsonl(tmp_path / f"in-{s}.jsonl", docs)
    return [str(tmp_path / "in-*.jsonl")], shard_docs


def expected_stream(tools, tokenizer, shard_docs, chunk_size):
    ids = tools.reference_ids(tokenizer, tools.round_robin_docs(shard_docs, chunk_size))
    return np.concatenate([np.array(x, dtype=np.int32) for x in ids])


def test_readers_start_while_the_build_runs(two_shards, tmp_path, tokenizer_path, tokenizer, tools, ray_cluster):
    inputs, shard_docs = two_shards
    out = str(tmp_path / "cache")
    handle = start_build(
        inputs, out, processor=slow_processor(tokenizer_path, 0.15), chunk_size=2, progress=False, in_process=False
    )
    windows = open_cache(out, timeout=60, poll_interval=0.05).token_windows(8)
    first = windows.get_batch([0], timeout=60)
    assert not handle.done(), "the first example must be readable before the build ends"
    assert windows.final_num_examples() is None
    stream = expected_stream(tools, tokenizer, shard_docs, 2)
    total = len(stream) // 8
    np.testing.assert_array_equal(first[0], stream[:8])
    late = windows.get_batch([total - 1], timeout=60)  # waits for the last chunks
    np.testing.assert_array_equal(late[0], stream[(total - 1) * 8 : total * 8])
    handle.wait(timeout=60)
    assert windows.wait_for_final(timeout=5) == total
    era = windows.era_shuffled(seed=1, era_length=7).get_batch(np.arange(total))
    assert sorted(map(tuple, era.tolist())) == sorted(map(tuple, stream[: total * 8].reshape(total, 8).tolist()))


def test_waiting_for_a_chunk_times_out_with_a_clear_error(tmp_path, tokenizer_path, tools):
    tools.write_jsonl(tmp_path / "one.jsonl", tools.make_docs(30, seed=3))
    out = str(tmp_path / "cache")
    handle = start_build(
        [str(tmp_path / "one.jsonl")], out, processor=slow_processor(tokenizer_path, 0.2), chunk_size=2, progress=False
    )
    windows = open_cache(out, timeout=60, poll_interval=0.05).token_windows(4)
    with pytest.raises(TimeoutError, match=r"waited 0\.3 s for 100000 examples"):
        windows.get_batch([99_999], timeout=0.3)
    handle.wait(timeout=60)
    with pytest.raises(IndexError, match="the finished cache does not have it"):
        windows.get_batch([99_999], timeout=5)


def test_second_builder_gets_a_lock_error_and_the_first_is_intact(
    two_shards, tmp_path, tokenizer_path, tokenizer, tools
):
    inputs, shard_docs = two_shards
    out = tmp_path / "cache"
    handle = start_build(inputs, str(out), processor=slow_processor(tokenizer_path, 0.15), chunk_size=2, progress=False)
    deadline = time.monotonic() + 60
    while not (out / "ledger.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(CacheLockedError, match=r"another builder holds the lock .*pid \d+") as info:
        build_cache(inputs, str(out), tokenizer=str(tokenizer_path), chunk_size=2, progress=False)
    assert str(out) in str(info.value)
    handle.wait(timeout=60)
    assert verify_cache(str(out)).ok
    windows = open_cache(str(out)).token_windows(8)
    total = windows.final_num_examples()
    np.testing.assert_array_equal(
        windows.get_batch(np.arange(total)).reshape(-1), expected_stream(tools, tokenizer, shard_docs, 2)[: total * 8]
    )
    assert not (out / ".locks").exists() and not (out / ".lock").exists()


def _write_lock(path, pid, legacy=False):
    """A lock file of another builder: the epoch layout of 0.3, or the single `.lock` file of 0.1/0.2."""
    info = {"token": "someone-else", "host": socket.gethostname(), "pid": pid, "heartbeat": time.time()}
    target = path / ".lock" if legacy else path / ".locks" / "00000007.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(info))


def test_lock_of_a_live_process_blocks_and_of_a_dead_one_is_taken_over(tmp_path, tokenizer_path, tools):
    tools.write_jsonl(tmp_path / "one.jsonl", tools.make_docs(6, seed=4))
    for legacy in (False, True):
        out = tmp_path / f"cache-{legacy}"
        _write_lock(out, os.getppid(), legacy=legacy)
        with pytest.raises(CacheLockedError, match=f"pid {os.getppid()}"):
            build_cache([str(tmp_path / "one.jsonl")], str(out), tokenizer=str(tokenizer_path), progress=False)
        assert [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()] == [
            ".lock" if legacy else ".locks/00000007.json"
        ]  # nothing written
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        _write_lock(out, dead.pid, legacy=legacy)
        result = build_cache([str(tmp_path / "one.jsonl")], str(out), tokenizer=str(tokenizer_path), progress=False)
        assert result.docs == 6 and not (out / ".lock").exists() and not (out / ".locks").exists()
        assert verify_cache(str(out)).ok


def test_cache_on_an_fsspec_memory_url(two_shards, tokenizer_path, tokenizer, tools):
    import fsspec

    inputs, shard_docs = two_shards
    url = "memory://shard-cache-test/cache"
    result = build_cache(inputs, url, tokenizer=str(tokenizer_path), chunk_size=3, progress=False)
    fs = fsspec.filesystem("memory")
    assert fs.exists("/shard-cache-test/cache/ledger.json") and not fs.find("/shard-cache-test/cache/.locks")
    assert verify_cache(url).ok
    windows = open_cache(url).token_windows(8)
    total = windows.final_num_examples()
    assert total * 8 <= result.tokens < (total + 1) * 8
    np.testing.assert_array_equal(
        windows.get_batch(np.arange(total)).reshape(-1), expected_stream(tools, tokenizer, shard_docs, 3)[: total * 8]
    )
    fs.rm("/shard-cache-test", recursive=True)


def interruptible_processor(tokenizer_path, marker_dir) -> TokenizerProcessor:
    """The tokenizer processor; once `marker_dir/hold` exists it waits in each chunk until interrupted.

    A task waiting in it leaves `inside-PID` in `marker_dir`, and `interrupted-PID` when the interrupt reaches it.
    """
    marker_dir = str(marker_dir)

    class InterruptibleTokenizerProcessor(TokenizerProcessor):
        def __call__(self, docs):
            held = os.path.exists(os.path.join(marker_dir, "hold"))
            if held:
                with open(os.path.join(marker_dir, f"inside-{os.getpid()}"), "w"):
                    pass
            try:
                # Held: a minute at most, so a lost interrupt fails the test instead of hanging it. Not yet held:
                # slow enough that neither shard finishes before the test holds them.
                for _ in range(1200 if held else 10):
                    time.sleep(0.05)
            except KeyboardInterrupt:  # what Ray raises in a task it asks to stop; a killed worker runs no code
                with open(os.path.join(marker_dir, f"interrupted-{os.getpid()}"), "w"):
                    pass
                raise
            return super().__call__(docs)

    return InterruptibleTokenizerProcessor(str(tokenizer_path))


def _markers(directory, prefix: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(prefix))


def test_a_stop_asks_the_shard_tasks_to_end_instead_of_killing_their_workers(
    two_shards, tmp_path, tokenizer_path, ray_cluster
):
    # A force-cancel kills the worker mid-stream, which Ray 2.60 could answer by aborting the driver at exit.
    inputs, _ = two_shards
    out, markers = tmp_path / "cache", tmp_path / "markers"
    markers.mkdir()
    handle = start_build(
        inputs,
        str(out),
        processor=interruptible_processor(tokenizer_path, markers),
        chunk_size=2,
        progress=False,
        in_process=False,
    )
    open_cache(str(out), timeout=60, poll_interval=0.05).token_windows(8).get_batch([0], timeout=60)
    (markers / "hold").touch()
    # Wait until both shard tasks are inside a chunk, however slowly a loaded machine started their workers.
    deadline = time.monotonic() + 60
    while len(_markers(markers, "inside-")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_markers(markers, "inside-")) == 2, "both shard tasks should be held inside a chunk"
    asked = time.monotonic()
    handle.stop(timeout=30)
    # Far less than the minute a held chunk would take: the stop interrupted the tasks rather than waited (10.5 s
    # was seen on a loaded 2-core machine, so the bound leaves room for a slow Ray under load).
    assert time.monotonic() - asked < 20 and handle.done()
    # Both shard tasks were mid-chunk: each got the interrupt in its own code and ended, before stop returned.
    assert [m.replace("inside", "interrupted") for m in _markers(markers, "inside-")] == _markers(
        markers, "interrupted-"
    )
    stopped = handle.wait(timeout=0)
    assert not stopped.finished and stopped.chunks > 0
    assert not json.loads((out / "ledger.json").read_text()).get("error")
    assert verify_cache(str(out)).ok


def test_a_stopped_build_keeps_its_chunks_and_building_again_resumes_it(
    two_shards, tmp_path, tokenizer_path, tokenizer, tools, ray_cluster
):
    inputs, shard_docs = two_shards
    out = tmp_path / "cache"
    processor = slow_processor(tokenizer_path, 0.15)
    handle = start_build(inputs, str(out), processor=processor, chunk_size=2, progress=False, in_process=False)
    open_cache(str(out), timeout=60, poll_interval=0.05).token_windows(8).get_batch([0], timeout=60)
    asked = time.monotonic()
    handle.stop(timeout=30)
    assert time.monotonic() - asked < 5 and handle.done()
    stopped = handle.wait(timeout=0)
    all_chunks = 40 // 2 + 30 // 2
    assert not stopped.finished and 0 < stopped.chunks < all_chunks
    ledger = json.loads((out / "ledger.json").read_text())
    assert not ledger["finished"] and not ledger.get("error"), "a stop is not a failure: readers keep waiting"
    assert not (out / ".locks").exists()
    assert verify_cache(str(out)).ok

    resumed = build_cache(inputs, str(out), processor=processor, chunk_size=2, progress=False)
    assert resumed.finished and resumed.chunks == all_chunks
    windows = open_cache(str(out)).token_windows(8)
    total = windows.final_num_examples()
    np.testing.assert_array_equal(
        windows.get_batch(np.arange(total)).reshape(-1), expected_stream(tools, tokenizer, shard_docs, 2)[: total * 8]
    )


def test_taking_the_lock_survives_its_directory_vanishing_as_a_builder_releases(tmp_path, monkeypatch):
    """A releasing builder removes the empty `.locks`; one taking the lock then must make it again, not fail."""
    from shard_cache import fs as fs_module
    from shard_cache.lock import acquire
    from storage_io import atomic

    real_makedirs, vanished = os.makedirs, []

    def makedirs_then_release(path, exist_ok=False):
        real_makedirs(path, exist_ok=exist_ok)
        if path.endswith(".locks") and not vanished:  # the other builder's release lands right here, once
            vanished.append(path)
            os.rmdir(path)

    monkeypatch.setattr(atomic.os, "makedirs", makedirs_then_release)
    url = str(tmp_path / "cache")
    fs, root = fs_module.get_fs(url)
    lock = acquire(fs, root, url)
    assert vanished and lock.still_held() and (tmp_path / "cache" / ".locks" / "00000001.json").exists()
    lock.release()
    assert not (tmp_path / "cache" / ".locks").exists()


def test_building_a_finished_cache_needs_no_lock(tmp_path, tokenizer_path, tools):
    """Six builds of a finished cache at once must all succeed: one holding the lock must not refuse the rest."""
    tools.write_jsonl(tmp_path / "one.jsonl", tools.make_docs(6, seed=4))
    out = tmp_path / "cache"
    first = build_cache([str(tmp_path / "one.jsonl")], str(out), tokenizer=str(tokenizer_path), progress=False)
    _write_lock(out, os.getppid())  # a live builder holds the lock right now
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    again = build_cache([str(tmp_path / "one.jsonl")], str(out), tokenizer=str(tokenizer_path), progress=False)
    assert (again.docs, again.tokens, again.chunks, again.finished) == (6, first.tokens, first.chunks, True)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing written


def test_a_reader_stops_waiting_once_this_process_s_build_fails_before_its_first_chunk(tmp_path, tokenizer_path):
    """A build that fails before its ledger exists leaves nothing on storage to see (a full disk, no inputs):
    the reader in the same process hears of it at its next poll, instead of waiting out its timeout."""
    out = str(tmp_path / "cache")
    handle = start_build([str(tmp_path / "missing-*.jsonl")], out, tokenizer=str(tokenizer_path), progress=False)
    asked = time.monotonic()
    with pytest.raises(ShardCacheError, match=r"failed before it committed one: .*missing-\*\.jsonl"):
        open_cache(out, timeout=120, poll_interval=0.05)
    assert time.monotonic() - asked < 30
    with pytest.raises(ShardCacheError):
        handle.wait(timeout=10)
