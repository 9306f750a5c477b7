"""Faults in a cache's chunks and ledger and in a trained tokenizer: truncation, a flipped bit, a deleted file, no
read permission, a full disk, and a file half-written by a killed writer. Under each: a message that names the
file and the fix, a non-zero exit without a traceback from the CLI, and nothing intact modified."""

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest

from shard_cache import (
    CacheCorruptError,
    ChunkCorruptError,
    ShardCacheError,
    StorageError,
    TokenizerFileError,
    build_cache,
    load_tokenizer,
    open_cache,
    repair_cache,
    train_tokenizer,
    verify_cache,
)
from shard_cache.cli import main


@pytest.fixture(scope="module")
def built(tmp_path_factory, tokenizer_path, tools):
    root = tmp_path_factory.mktemp("faults")
    for s, n in enumerate((9, 7)):
        tools.write_jsonl(root / f"in-{s}.jsonl", tools.make_docs(n, seed=90 + s))
    cache = root / "cache"
    build_cache(
        [str(root / "in-{0..1}.jsonl")], str(cache), tokenizer=str(tokenizer_path), chunk_size=3, progress=False
    )
    return root, cache, tools.tree_bytes(cache)


@pytest.fixture
def cache(built, tmp_path):
    """A fresh copy of the built cache (its inputs stay where the build found them)."""
    _, original, _ = built
    copy = tmp_path / "cache"
    shutil.copytree(original, copy)
    return copy


def _flip(path, offset=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x08
    path.write_bytes(bytes(data))


def _truncate(path, size=7):
    path.write_bytes(path.read_bytes()[:size])


def _all_batches(cache_dir, **kwargs):
    windows = open_cache(str(cache_dir), **kwargs).token_windows(4)
    return windows.get_batch(np.arange(windows.final_num_examples()))


def _mtimes(root, exclude=()):
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and p not in exclude}


CHUNK = "chunks/00001/000001.parquet"


def _half_written(path):
    """What a killed writer leaves: the first half of the file in place (a writer that writes in place, or a copy
    killed mid-way), and beside it the temporary file of a writer that writes then renames, as shard-cache does."""
    data = path.read_bytes()
    (path.parent / f".tmp-0123{path.name}").write_bytes(data[: len(data) // 2])
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("fault", ["truncated", "flipped", "deleted", "half-written"])
def test_a_damaged_chunk_is_named_with_its_source_and_repaired_to_the_same_bytes(
    fault, built, cache, tokenizer_path, tools, capsys
):
    root, _, reference = built
    expected = _all_batches(built[1])
    victim = cache / CHUNK
    faults = {"truncated": _truncate, "flipped": _flip, "deleted": lambda p: p.unlink(), "half-written": _half_written}
    faults[fault](victim)
    before = _mtimes(cache, exclude={victim})
    with pytest.raises(ChunkCorruptError) as info:
        _all_batches(cache)
    message = str(info.value)
    assert str(victim) in message and f"source: {root / 'in-1.jsonl'}" in message and "--repair" in message
    assert info.value.source_present and (info.value.shard, info.value.chunk) == (1, 1)
    assert main(["verify", str(cache), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert str(victim) in err and "--repair --tokenizer" in err and "Traceback" not in err
    assert _mtimes(cache, exclude={victim}) == before  # readers and verify touch nothing
    # A reader given the tokenizer rebuilds the chunk from its source and reads on.
    np.testing.assert_array_equal(_all_batches(cache, repair_with=str(tokenizer_path)), expected)
    # The same bytes as the build wrote (a killed writer's temporary file is left for the next build to remove).
    assert {k: v for k, v in tools.tree_bytes(cache).items() if "/.tmp-" not in k} == reference
    after = _mtimes(cache)
    rewritten = {p for p in after if after[p] != before.get(p)}
    assert rewritten <= {victim, victim.with_suffix(".json")}  # only the damaged chunk and its marker


def test_a_damaged_chunk_whose_source_is_gone_is_an_error_naming_both(cache, tmp_path, tokenizer_path):
    settings = json.loads((cache / "cache.json").read_text())
    gone = str(tmp_path / "gone.jsonl")
    settings["shards"][1]["files"] = [gone]  # as if the input had been deleted since the build
    (cache / "cache.json").write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
    _flip(cache / CHUNK)
    with pytest.raises(ChunkCorruptError, match=r"source: .*gone\.jsonl\. Its source is gone, so it cannot be rebuilt"):
        _all_batches(cache)
    with pytest.raises(ChunkCorruptError, match=r"gone\.jsonl"):
        repair_cache(str(cache), tokenizer=str(tokenizer_path))


def test_a_chunk_rebuilt_from_a_changed_source_is_refused(built, cache, tokenizer_path, tmp_path):
    root, _, _ = built
    changed = tmp_path / "in-1.jsonl"
    changed.write_text((root / "in-1.jsonl").read_text().replace("doc", "DOC"))
    settings = json.loads((cache / "cache.json").read_text())
    settings["shards"][1]["files"] = [str(changed)]
    (cache / "cache.json").write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
    _truncate(cache / CHUNK)
    with pytest.raises(ChunkCorruptError, match="the source changed since the build"):
        repair_cache(str(cache), tokenizer=str(tokenizer_path))
    assert len((cache / CHUNK).read_bytes()) == 7  # left as it was


@pytest.mark.parametrize("fault", ["truncated", "flipped", "deleted", "half-written"])
def test_a_damaged_ledger_is_named_and_the_build_command_rebuilds_it(
    fault, built, cache, tokenizer_path, tools, capsys
):
    root, _, reference = built
    ledger = cache / "ledger.json"
    if fault == "truncated":
        _truncate(ledger, 40)
    elif fault == "flipped":
        _flip(ledger)
    elif fault == "deleted":
        ledger.unlink()
    else:  # a writer killed mid-way: the first half of the file, and its temporary file beside it
        (cache / ".tmp-0123-ledger.json").write_bytes(ledger.read_bytes()[:100])
        _truncate(ledger, len(ledger.read_bytes()) // 2)
    chunks_before = _mtimes(cache / "chunks")
    if fault == "deleted":
        with pytest.raises(ShardCacheError, match=r"no ledger\.json there.* run the build command again"):
            open_cache(str(cache))
    else:
        with pytest.raises(CacheCorruptError, match=r"ledger\.json: damaged.* rebuilds the ledger from the chunk"):
            open_cache(str(cache))
    assert main(["inspect", str(cache)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "ledger.json" in err and "build" in err and "Traceback" not in err
    assert main(["verify", str(cache), "--no-progress"]) != 0
    capsys.readouterr()
    result = build_cache(
        [str(root / "in-{0..1}.jsonl")], str(cache), tokenizer=str(tokenizer_path), chunk_size=3, progress=False
    )
    assert result.finished and result.docs == 16
    assert tools.tree_bytes(cache) == reference  # the same ledger as the build wrote, the leftover file removed
    assert _mtimes(cache / "chunks") == chunks_before  # no intact chunk was written again


@pytest.mark.parametrize("fault", ["truncated", "flipped", "deleted", "half-written"])
def test_a_damaged_tokenizer_names_the_file_and_the_fix(fault, tmp_path, tools, capsys):
    path = tmp_path / "tokenizer.json"
    train_tokenizer(tools.make_docs(40, seed=95), 300, save_path=path)
    good = path.read_bytes()
    if fault == "truncated":
        _truncate(path, len(good) // 3)
    elif fault == "flipped":
        _flip(path)
    elif fault == "deleted":
        path.unlink()
    else:  # written in place by a killed writer, with no checksum file (as tokenizers' own save would leave it)
        (tmp_path / "tokenizer.json.sha256").unlink()
        _truncate(path, len(good) // 2)
    with pytest.raises(TokenizerFileError) as info:
        load_tokenizer(str(path))
    assert str(path) in str(info.value)
    if fault != "deleted":
        assert "damaged" in str(info.value) and "delete it" in str(info.value) and "data.tokenizer" in str(info.value)
    code = main(["build", str(tmp_path / "x.jsonl"), "--tokenizer", str(path), "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and str(path) in err and "Traceback" not in err
    assert not (tmp_path / "c").exists()


# -- no read permission: root ignores permission bits, so the CLI runs without the capabilities that let it --


def _without_dac_capabilities():
    """preexec_fn: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so that after exec this
    process, though root, obeys permission bits."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def _cli_without_read_permission(args):
    probe = (
        subprocess.run(
            ["cat", "/proc/self/status"], preexec_fn=_without_dac_capabilities, capture_output=True, text=True
        )
        if os.geteuid() == 0
        else None
    )
    if probe is not None and probe.returncode != 0:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here, and root reads any file: no permission fault to make")
    return subprocess.Popen(
        [sys.executable, "-m", "shard_cache.cli", *args],
        preexec_fn=_without_dac_capabilities if os.geteuid() == 0 else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_files_without_read_permission_are_named_with_the_fix(built, cache, tmp_path, tools):
    token_file = tmp_path / "tok" / "tokenizer.json"
    train_tokenizer(tools.make_docs(40, seed=96), 300, save_path=token_file)
    copy = tmp_path / "cache-ledger"
    shutil.copytree(cache, copy)
    chunk, ledger = cache / CHUNK, copy / "ledger.json"
    for path in (chunk, ledger, token_file):
        path.chmod(0)
    before = {p: p.read_bytes() for p in (chunk, ledger, token_file)}
    runs = {
        "chunk": _cli_without_read_permission(["verify", str(cache), "--no-progress"]),
        "ledger": _cli_without_read_permission(["inspect", str(copy)]),
        "tokenizer": _cli_without_read_permission(
            ["build", str(built[0] / "in-0.jsonl"), "--tokenizer", str(token_file), "--out", str(tmp_path / "c")]
        ),
    }
    for what, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode != 0, (what, out, err)
        assert "permission denied" in err and "readable" in err and "Traceback" not in err, (what, err)
    for path, data in before.items():
        path.chmod(0o644)
        assert path.read_bytes() == data


# -- a full disk: a small tmpfs mounted by the test --


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount_point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}): no full disk to make")
    try:
        yield mount_point
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["umount", "-l", str(mount_point)], check=False, capture_output=True)


def _slow_processor(tokenizer_path, delay):
    """The tokenizer processor with a sleep per chunk (defined in a function, so that Ray ships it by value)."""
    import time

    from shard_cache import TokenizerProcessor

    class SlowTokenizerProcessor(TokenizerProcessor):
        def __call__(self, docs):
            time.sleep(delay)  # the ledger gets commits in before the disk fills; the output is unchanged
            return super().__call__(docs)

    return SlowTokenizerProcessor(str(tokenizer_path))


def test_a_full_disk_stops_the_build_keeps_what_is_committed_and_the_build_resumes(
    small_disk, tmp_path, tokenizer_path, tools, ray_cluster, capsys
):
    for s in range(2):
        tools.write_jsonl(tmp_path / f"big-{s}.jsonl", tools.make_docs(40, seed=97 + s))
    inputs = str(tmp_path / "big-{0..1}.jsonl")
    reference = tmp_path / "reference"
    build_cache([inputs], str(reference), tokenizer=str(tokenizer_path), chunk_size=2, progress=False)
    out = small_disk / "cache"
    with pytest.raises(StorageError, match=r"cannot write it: no space left on the device\. Free space"):
        build_cache([inputs], str(out), processor=_slow_processor(tokenizer_path, 0.05), chunk_size=2, progress=False)
    ledger = json.loads((out / "ledger.json").read_text())  # the last committed state, intact
    assert not ledger["finished"] and sum(len(s["chunks"]) for s in ledger["shards"]) > 0
    assert verify_cache(str(out)).ok  # a worker killed mid-write may leave a .tmp- file: the next build removes it
    # The command on the still-full disk: one paragraph, exit 2, and what was committed stays.
    # A .tmp- file is not committed (a worker stopped mid-write): the next build may remove it, as it does.
    committed = {k: v for k, v in tools.tree_bytes(out).items() if ".tmp-" not in k}
    args = ["build", inputs, "--tokenizer", str(tokenizer_path), "--out", str(out), "--chunk-size", "2"]
    assert main([*args, "--ray-address", ray_cluster, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no space left on the device" in err and "run the same command" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert {k: v for k, v in tools.tree_bytes(out).items() if k in committed} == committed
    # A tokenizer saved to the full disk fails the same way and leaves no file behind.
    filler = small_disk / "filler"
    with contextlib.suppress(OSError), filler.open("wb") as f:
        while True:  # whatever room the failed writes left
            f.write(b"\0" * 4096)
            f.flush()
    with pytest.raises(StorageError, match="no space left"):
        train_tokenizer(tools.make_docs(50, seed=99), 300, save_path=small_disk / "tok.json")
    assert not (small_disk / "tok.json").exists() and not list(small_disk.glob(".tmp-*"))
    filler.unlink()
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    assert main([*args, "--ray-address", ray_cluster, "--no-progress"]) == 0
    assert tools.tree_bytes(out) == tools.tree_bytes(reference)


def test_storage_errors_are_storage_io_errors_with_their_kind(tmp_path):
    """shard-cache's StorageError is storage_io's too: callers of every package catch one type and read `reason`."""
    import storage_io
    from shard_cache.fs import get_fs, write_atomic

    (tmp_path / "notes").write_text("a file")
    fs, path = get_fs(str(tmp_path / "notes" / "ledger.json"))
    with pytest.raises(StorageError) as caught:
        write_atomic(fs, path, b"{}")
    assert isinstance(caught.value, storage_io.StorageError) and caught.value.reason == "not_a_directory"
    assert caught.value.location == path and f"{path}: cannot write it" in str(caught.value)
    assert "is a file, not a directory" in str(caught.value)
