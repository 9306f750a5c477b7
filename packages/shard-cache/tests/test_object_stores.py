"""Caches, inputs and tokenizers on real object-store servers (moto's S3 server, gcp-storage-emulator), checked
with plain clients: boto3 for what lands in the bucket, pyarrow over fsspec for the chunks."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest

from shard_cache import (
    CacheLockedError,
    ChunkCorruptError,
    build_cache,
    load_tokenizer,
    open_cache,
    train_tokenizer,
    verify_cache,
)
from shard_cache.cli import main
from shard_cache.fs import create_exclusive, get_fs
from shard_cache.lock import acquire


def _s3():
    import boto3

    return boto3.client("s3")


def _objects(bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under `prefix`, by key relative to it, read with plain boto3."""
    client = _s3()
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.extend(item["Key"] for item in page.get("Contents", []))
    return {k[len(prefix) :]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in sorted(keys)}


def _upload(bucket: str, key: str, data: bytes) -> None:
    _s3().put_object(Bucket=bucket, Key=key, Body=data)


def _stream(tools, tokenizer, shard_docs, chunk_size):
    ids = tools.reference_ids(tokenizer, tools.round_robin_docs(shard_docs, chunk_size))
    return np.concatenate([np.array(x, dtype=np.int32) for x in ids])


def test_s3_build_inspect_verify_read_and_repair(s3_server, ray_cluster, tokenizer_path, tokenizer, tools, capsys):
    bucket = s3_server.new_bucket()
    shard_docs = [tools.make_docs(7, seed=60), tools.make_docs(5, seed=61)]
    for s, docs in enumerate(shard_docs):
        _upload(bucket, f"in/data_{s + 1}.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    _upload(bucket, "tok/tokenizer.json", tokenizer_path.read_bytes())
    cache = s3_server.url(bucket, "cache")
    args = ["build", s3_server.url(bucket, "in/data_{1..2}.jsonl"), "--tokenizer", s3_server.url(bucket, "tok")]
    assert main([*args, "--out", cache, "--chunk-size", "3", "--ray-address", ray_cluster, "--no-progress"]) == 0
    assert "2 shards, 5 chunks, 12 documents" in capsys.readouterr().out

    # What is in the bucket, seen by boto3: the cache's files and nothing else (no lock, no temporary file).
    objects = _objects(bucket, "cache/")
    chunk_keys = [
        f"chunks/{s:05d}/{c:06d}.{ext}" for s, n in ((0, 3), (1, 2)) for c in range(n) for ext in ("json", "parquet")
    ]
    assert sorted(objects) == sorted(["cache.json", "ledger.json", *chunk_keys])
    ledger = json.loads(objects["ledger.json"])
    assert ledger["finished"] and ledger["order"] == [[0, 0], [1, 0], [0, 1], [1, 1], [0, 2]]
    # Plain pyarrow over fsspec reads the chunks: the tokenizer's ids, one EOS per document.
    fs = fsspec.filesystem("s3")
    with fs.open(f"{bucket}/cache/chunks/00000/000000.parquet", "rb") as f:
        first = pq.read_table(f).column("input_ids").to_pylist()
    assert first == tools.reference_ids(tokenizer, shard_docs[0][:3])

    assert main(["inspect", cache]) == 0 and json.loads(capsys.readouterr().out)["docs"] == 12
    assert main(["verify", cache, "--no-progress"]) == 0
    windows = open_cache(cache).token_windows(8)
    stream = _stream(tools, tokenizer, shard_docs, 3)
    total = windows.final_num_examples()
    np.testing.assert_array_equal(windows.get_batch(np.arange(total)).reshape(-1), stream[: total * 8])

    # A flipped bit in a chunk in the bucket: readers and verify name it; repair puts back the same bytes.
    key = "cache/chunks/00001/000000.parquet"
    good = objects["chunks/00001/000000.parquet"]
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0x10
    _upload(bucket, key, bytes(damaged))
    with pytest.raises(ChunkCorruptError, match=r"00001/000000\.parquet: committed chunk 0 of shard 1 is damaged"):
        open_cache(cache).token_windows(8).get_batch(np.arange(total))
    assert main(["verify", cache, "--no-progress"]) == 1
    assert "00001/000000.parquet: its CRC-32C differs" in capsys.readouterr().err
    assert main(["verify", cache, "--repair", "--tokenizer", s3_server.url(bucket, "tok"), "--no-progress"]) == 0
    assert _objects(bucket, "cache/") == objects

    # The tokenizer trained straight into the bucket, with its checksum beside it, loads back.
    trained = s3_server.url(bucket, "trained/tokenizer.json")
    made = train_tokenizer(tools.make_docs(50, seed=62), 300, save_path=trained)
    assert sorted(_objects(bucket, "trained/")) == ["tokenizer.json", "tokenizer.json.sha256"]
    assert load_tokenizer(trained).to_str() == made.to_str()


def test_s3_locks_use_conditional_writes(s3_server):
    bucket = s3_server.new_bucket()
    fs, root = get_fs(s3_server.url(bucket, "c"))
    create_exclusive(fs, f"{root}/x", b"first")
    with pytest.raises(FileExistsError):
        create_exclusive(fs, f"{root}/x", b"second")  # moto answers 412 to If-None-Match: *
    assert _objects(bucket, "c/") == {"x": b"first"}
    held = acquire(fs, root, "the cache")
    with pytest.raises(CacheLockedError, match="another builder holds the lock"):
        acquire(fs, root, "the cache")
    held.release()
    acquire(fs, root, "the cache").release()
    assert _objects(bucket, "c/") == {"x": b"first"}


BUILD_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from shard_cache import TokenizerProcessor, build_cache

    class SlowTokenizerProcessor(TokenizerProcessor):
        def __call__(self, docs):
            time.sleep(0.15)  # slow enough to be killed mid-way; the output is unchanged
            return super().__call__(docs)

    inputs, out, tokenizer, address = sys.argv[1:5]
    build_cache([inputs], out, processor=SlowTokenizerProcessor(tokenizer), chunk_size=2, ray_address=address,
                progress=False)
    """
)


def test_s3_build_killed_mid_way_resumes_to_the_same_bytes(s3_server, ray_cluster, tokenizer_path, tools, tmp_path):
    bucket = s3_server.new_bucket()
    for s, n in enumerate((14, 10)):
        docs = tools.make_docs(n, seed=70 + s)
        _upload(bucket, f"in/part-{s}.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    inputs = s3_server.url(bucket, "in/part-*.jsonl")
    build_cache(
        [inputs], s3_server.url(bucket, "reference"), tokenizer=str(tokenizer_path), chunk_size=2, progress=False
    )
    reference = _objects(bucket, "reference/")
    out = s3_server.url(bucket, "cache")
    script = tmp_path / "build.py"
    script.write_text(BUILD_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), inputs, out, str(tokenizer_path), ray_cluster],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=os.environ.copy(),
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        try:  # one small GET: moto serves from this process, and a heavier poll would slow the build down
            ledger = json.loads(_s3().get_object(Bucket=bucket, Key="cache/ledger.json")["Body"].read())
        except Exception:
            ledger = {"shards": []}
        if sum(len(s["chunks"]) for s in ledger["shards"]) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, f"the build ended before it could be killed: {proc.stdout.read().decode()}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = _objects(bucket, "cache/")
    assert not json.loads(left["ledger.json"])["finished"] and any(k.startswith(".locks/") for k in left)
    time.sleep(0.5)  # let Ray reap the dead driver's workers
    result = build_cache([inputs], out, tokenizer=str(tokenizer_path), chunk_size=2, progress=False)
    assert result.finished and result.docs == 24
    assert _objects(bucket, "cache/") == reference  # every object, byte for byte; the dead lock is gone too
    assert verify_cache(out).ok


def test_gcs_build_inspect_verify_and_a_tokenizer_directory(gcs_server, tokenizer_path, tokenizer, tools):
    bucket = gcs_server.new_bucket()
    fs = fsspec.filesystem("gs")
    shard_docs = [tools.make_docs(6, seed=80), tools.make_docs(4, seed=81)]
    for s, docs in enumerate(shard_docs):
        fs.pipe_file(f"{bucket}/in/part-{s}.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    fs.pipe_file(f"{bucket}/hf-tok/tokenizer.json", tokenizer_path.read_bytes())  # an HF tokenizer directory
    cache = gcs_server.url(bucket, "cache")
    result = build_cache(
        [gcs_server.url(bucket, "in/part-*.jsonl")],
        cache,
        tokenizer=gcs_server.url(bucket, "hf-tok"),
        chunk_size=4,
        progress=False,
    )
    assert result.docs == 10 and result.chunks == 3
    fs.invalidate_cache()
    names = sorted(p.split("/cache/", 1)[1] for p in fs.find(f"{bucket}/cache"))
    assert names == [
        "cache.json",
        "chunks/00000/000000.json",
        "chunks/00000/000000.parquet",
        "chunks/00000/000001.json",
        "chunks/00000/000001.parquet",
        "chunks/00001/000000.json",
        "chunks/00001/000000.parquet",
        "ledger.json",
    ]
    with fs.open(f"{bucket}/cache/chunks/00001/000000.parquet", "rb") as f:
        assert pq.read_table(f).column("input_ids").to_pylist() == tools.reference_ids(tokenizer, shard_docs[1])
    assert main(["inspect", cache]) == 0
    assert main(["verify", cache, "--no-progress"]) == 0
    windows = open_cache(cache).token_windows(4)
    stream = _stream(tools, tokenizer, shard_docs, 4)
    total = windows.final_num_examples()
    np.testing.assert_array_equal(windows.get_batch(np.arange(total)).reshape(-1), stream[: total * 4])
