"""The data modules one by one: inputs, tokenizer provision, cache naming, each process's slice of a batch."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import shard_cache
from lm_train.config import DataConfig
from lm_train.data.batches import ProcessSlice
from lm_train.data.caches import cache_tag
from lm_train.data.inputs import Inputs, resolve_inputs
from lm_train.data.tokenizer import provide_tokenizer, trained_tokenizer_path, wait_for_tokenizer
from lm_train.errors import ConfigError, DataError

TEXTS = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "import os\nprint(os.sep)\n"] * 20


def _corpus(tmp_path, n=3):
    files = []
    for i in range(n):
        path = tmp_path / f"train_{i}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[i::n]), encoding="utf-8")
        files.append(path)
    return files


def test_inputs_expand_ranges_and_name_the_key_that_matches_nothing(tmp_path):
    _corpus(tmp_path)
    config = DataConfig(
        train_urls=(str(tmp_path / "train_{0..2}.jsonl"),), validation_urls=(str(tmp_path / "train_0.jsonl"),)
    )
    inputs = resolve_inputs(config)
    assert [p.rsplit("/", 1)[-1] for p in inputs.train] == ["train_0.jsonl", "train_1.jsonl", "train_2.jsonl"]
    assert len(inputs.validation) == 1 and inputs.fmt == "auto"
    with pytest.raises(DataError, match=r"data\.train_urls"):
        resolve_inputs(DataConfig(train_urls=(str(tmp_path / "missing_*.jsonl"),)))
    builtin = resolve_inputs(DataConfig(builtin="python_stdlib"))
    assert builtin.fmt == "text" and builtin.train and builtin.validation
    assert not set(builtin.train) & set(builtin.validation)


def test_tokenizer_is_trained_once_then_reused_and_other_processes_wait_for_it(tmp_path):
    sources = []
    for i, text in enumerate(TEXTS[:3]):
        path = tmp_path / f"s{i}.py"
        path.write_text(text * 10, encoding="utf-8")
        sources.append(str(path))
    config = DataConfig(builtin="python_stdlib", cache_dir=str(tmp_path / "cache"), vocab_size=300)
    found: list[str] = []
    waiter = threading.Thread(target=lambda: found.append(wait_for_tokenizer(config, timeout=60)))
    waiter.start()  # a non-building process, started before the tokenizer exists
    path = provide_tokenizer(config, Inputs(sources, [], "text"), progress=False)
    waiter.join(timeout=60)
    assert path == trained_tokenizer_path(config) and found == [path]
    first = Path(path).stat().st_mtime_ns
    time.sleep(0.01)
    assert provide_tokenizer(config, Inputs(sources, [], "text"), progress=False) == path
    assert Path(path).stat().st_mtime_ns == first  # reused, not retrained
    assert shard_cache.load_tokenizer(path).get_vocab_size() <= 300
    # Written atomically by shard-cache, with the checksum that every later load checks; no stray files.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "tokenizer-bpe300.json",
        "tokenizer-bpe300.json.sha256",
    ]
    with open(path, "r+b") as f:  # a damaged tokenizer is refused, not tokenized with
        f.seek(10)
        f.write(b"#")
    with pytest.raises(shard_cache.ShardCacheError, match=r"tokenizer-bpe300\.json"):
        shard_cache.load_tokenizer(path)


def test_tokenizer_and_cache_tag_at_a_bucket_url(s3_server, tmp_path):
    """data.cache_dir at s3://: the BPE is trained into the bucket (with its checksum), reused, and named."""
    import boto3

    sources = []
    for i, text in enumerate(TEXTS[:3]):
        path = tmp_path / f"s{i}.py"
        path.write_text(text * 10, encoding="utf-8")
        sources.append(str(path))
    bucket = s3_server.new_bucket("tok")
    config = DataConfig(builtin="python_stdlib", cache_dir=s3_server.url(bucket, "caches"), vocab_size=300)
    path = provide_tokenizer(config, Inputs(sources, [], "text"), progress=False)
    assert path == f"s3://{bucket}/caches/tokenizer-bpe300.json" == wait_for_tokenizer(config, timeout=5)
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"]
    names = sorted(o["Key"] for o in listed)
    assert names == ["caches/tokenizer-bpe300.json", "caches/tokenizer-bpe300.json.sha256"]
    body = boto3.client("s3").get_object(Bucket=bucket, Key="caches/tokenizer-bpe300.json")["Body"].read()
    assert shard_cache.load_tokenizer(path).get_vocab_size() <= 300 and json.loads(body)["model"]["type"] == "BPE"
    # Reused, not retrained; and the cache folder is named by the tokenizer's content, read from the bucket.
    assert provide_tokenizer(config, Inputs(sources, [], "text"), progress=False) == path
    local = tmp_path / "copy.json"
    local.write_bytes(body)
    assert cache_tag(path, config) == cache_tag(str(local), config)
    configured = dataclasses.replace(config, tokenizer=path)
    assert provide_tokenizer(configured, Inputs([], [], "auto"), progress=False) == path
    with pytest.raises(DataError, match=r"data\.tokenizer: s3://.*/nope\.json does not exist"):
        provide_tokenizer(
            dataclasses.replace(config, tokenizer=s3_server.url(bucket, "nope.json")),
            Inputs([], [], "auto"),
            progress=False,
        )


def test_tokenizer_errors_name_the_key(tmp_path):
    missing = DataConfig(builtin="python_stdlib", tokenizer=str(tmp_path / "nope.json"))
    with pytest.raises(DataError, match=r"data\.tokenizer: .*nope\.json does not exist"):
        provide_tokenizer(missing, Inputs([], [], "text"), progress=False)
    with pytest.raises(DataError, match="can be trained on first use only"):
        provide_tokenizer(
            DataConfig(builtin="python_stdlib", cache_dir=str(tmp_path)), Inputs([], [], "auto"), progress=False
        )
    with pytest.raises(DataError, match="Waited 0 s for process 0"):
        wait_for_tokenizer(DataConfig(builtin="python_stdlib", cache_dir=str(tmp_path / "empty")), timeout=0)


def test_cache_folder_names_the_tokenizer_content_the_cache_format_and_the_eos_setting(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    shard_cache.train_tokenizer(TEXTS, 280, save_path=a)
    shard_cache.train_tokenizer(TEXTS, 300, save_path=b)  # another vocabulary: another tokenizer
    config = DataConfig(builtin="python_stdlib")
    assert cache_tag(str(a), config) == cache_tag(str(a), config)
    # the folder of a shard-cache 0.3 cache (grouped files, refused by 0.4) is named without the format: not reused
    old = "tok-" + hashlib.sha256(a.read_bytes()).hexdigest()[:12]
    assert cache_tag(str(a), config) == old + "-sc4"
    assert cache_tag(str(a), config) != cache_tag(str(b), config)
    own = dataclasses.replace(config, enforce_eos=False)
    assert cache_tag(str(a), own) != cache_tag(str(a), config)


def test_enforce_eos_false_keeps_the_tokenizers_own_special_tokens(tmp_path):
    path = tmp_path / "tok.json"
    shard_cache.train_tokenizer(TEXTS, 280, save_path=path)
    docs = ["def f(x):", "import os"]
    appended = shard_cache.TokenizerProcessor(str(path))(docs).column("input_ids").to_pylist()
    own = shard_cache.TokenizerProcessor(str(path), enforce_eos=False)(docs).column("input_ids").to_pylist()
    eos = shard_cache.TokenizerProcessor(str(path)).eos_id
    assert [ids[-1] for ids in appended] == [eos, eos]
    assert [[*ids, eos] for ids in own] == appended  # this tokenizer adds no special token of its own
    assert shard_cache.TokenizerProcessor(str(path), enforce_eos=False).fingerprint()["enforce_eos"] is False
    assert "enforce_eos" not in shard_cache.TokenizerProcessor(str(path)).fingerprint()  # old caches still match


@pytest.mark.parametrize("count", [1, 2, 4])
def test_process_slices_tile_the_global_batch_in_order(count):
    positions = np.arange(40, 56)
    parts = [ProcessSlice(i, count).of(positions) for i in range(count)]
    assert np.array_equal(np.concatenate(parts), positions)
    assert len({len(p) for p in parts}) == 1


def test_a_small_corpus_is_built_in_process_with_no_ray_even_where_a_cluster_address_is_set(tmp_path):
    files = _corpus(tmp_path)
    tokenizer = tmp_path / "tok.json"
    shard_cache.train_tokenizer(TEXTS, 280, save_path=tokenizer)
    code = (
        "import sys, json; from lm_train.config import DataConfig; from lm_train.data.caches import prepare_data; "
        f"c = DataConfig(train_urls=tuple({[str(f) for f in files]!r}), tokenizer={str(tokenizer)!r}, "
        f"cache_dir={str(tmp_path / 'cache')!r}, chunk_size=4); "
        "d = prepare_data(c, progress=False); [b.wait(timeout=120) for b in d.builds]; "
        "print(json.dumps([len(d.builds), 'ray' in sys.modules]))"
    )
    # lm-train launch sets RAY_ADDRESS on every host: a small build still waits for no Ray (this one is unreachable)
    env = {"RAY_ADDRESS": "127.0.0.1:1", "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1]) == [1, False]
    assert shard_cache.open_cache(str(next((tmp_path / "cache").glob("tok-*/train")))).finished
    assert [DataConfig(train_urls=("x",), cache_build=b).build_in_process for b in ("auto", "in_process", "ray")] == [
        None,
        True,
        False,
    ]
    with pytest.raises(ConfigError, match=r"data.cache_build must be one of auto, in_process, ray, got 'local'"):
        DataConfig(train_urls=("x",), cache_build="local")
