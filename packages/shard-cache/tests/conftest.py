"""Fixtures for shard-cache tests: one small local Ray per session, a small trained tokenizer, corpora."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = [
    "the",
    "a",
    "cache",
    "shard",
    "token",
    "reader",
    "writer",
    "ray",
    "def",
    "return",
    "import",
    "class",
    "self",
    "value",
    "index",
    "chunk",
    "order",
    "seed",
]


def make_docs(count: int, seed: int = 0) -> list[str]:
    """Deterministic documents of varied length (5 to 80 words, some with newlines and non-ASCII)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(count):
        words = rng.choice(WORDS, size=int(rng.integers(5, 80)))
        text = " ".join(words)
        if i % 7 == 0:
            text = text.replace(" self ", "\n    self ") + " naïve café"
        docs.append(f"doc {seed}-{i}: {text}")
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A small quiet local Ray shared by every test of the session; yields its GCS address."""
    import ray

    ray.init(
        address="local",  # never another session's `ray start` cluster on this shared host
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 * 2**20,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
    )
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json trained on a small corpus (vocabulary 400)."""
    from shard_cache import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_tokenizer(make_docs(300, seed=99), 400, save_path=path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_path))


def reference_ids(tokenizer, docs: list[str]) -> list[list[int]]:
    """What the cache must hold for `docs`: plain tokenizers output plus one EOS each."""
    eos = tokenizer.token_to_id("<|endoftext|>")
    return [[*e.ids, eos] for e in tokenizer.encode_batch(docs, add_special_tokens=False)]


def round_robin_docs(shard_docs: list[list[str]], chunk_size: int) -> list[str]:
    """The documents in the cache's global order, computed independently: chunk r of each shard, round by round."""
    chunks = [[docs[i : i + chunk_size] for i in range(0, len(docs), chunk_size)] for docs in shard_docs]
    out = []
    for r in range(max(len(c) for c in chunks)):
        for shard_chunks in chunks:
            if r < len(shard_chunks):
                out.extend(shard_chunks[r])
    return out


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def tools():
    """The corpus helpers above, for test modules (conftest cannot be imported under importlib mode)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        make_docs=make_docs,
        write_jsonl=write_jsonl,
        reference_ids=reference_ids,
        round_robin_docs=round_robin_docs,
        tree_bytes=tree_bytes,
    )
