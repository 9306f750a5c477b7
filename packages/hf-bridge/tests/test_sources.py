"""Checkpoints and tokenizers at fsspec URLs (the in-memory filesystem stands in for gs:// or s3://)."""

import fsspec
import jax
import numpy as np
import pytest

import hf_bridge
from hf_bridge import HfBridgeError


@pytest.fixture
def memory_root():
    fs = fsspec.filesystem("memory")
    yield "memory://hf_bridge_tests"
    if fs.exists("/hf_bridge_tests"):
        fs.rm("/hf_bridge_tests", recursive=True)


def test_save_and_load_through_an_fsspec_url(tiny_gpt2, memory_root):
    model, config = tiny_gpt2
    url = f"{memory_root}/gpt2"
    hf_bridge.save_pretrained(model, config, url, max_shard_size=3000)
    fs = fsspec.filesystem("memory")
    names = {p.rsplit("/", 1)[-1] for p in fs.ls("/hf_bridge_tests/gpt2", detail=False)}
    assert {"config.json", "model.safetensors.index.json"} <= names
    assert sum(n.startswith("model-00001-of-") for n in names) == 1
    again, config_again = hf_bridge.load_pretrained(url)
    assert config_again == config
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert hf_bridge.read_hf_config(url)["n_embd"] == config.hidden_dim
    with pytest.raises(HfBridgeError, match="overwrite=True"):
        hf_bridge.save_pretrained(model, config, url)
    hf_bridge.save_pretrained(model, config, url, overwrite=True)  # one file now: the shards must go
    names = {p.rsplit("/", 1)[-1] for p in fs.ls("/hf_bridge_tests/gpt2", detail=False)}
    assert names == {"config.json", "model.safetensors"}
    assert hf_bridge.load_pretrained(url)[1] == config


def test_missing_url_and_pickles_at_a_url(memory_root):
    with pytest.raises(HfBridgeError, match="does not exist"):
        hf_bridge.load_pretrained(f"{memory_root}/nothing")
    fs = fsspec.filesystem("memory")
    fs.pipe("/hf_bridge_tests/old/config.json", b"{}")
    fs.pipe("/hf_bridge_tests/old/pytorch_model.bin", b"pickle")
    with pytest.raises(HfBridgeError, match="never unpickles"):
        hf_bridge.load_pretrained(f"{memory_root}/old")


@pytest.mark.parametrize(
    ("url", "variable"), [("s3://b/model", "AWS_ENDPOINT_URL"), ("gs://b/model", "STORAGE_EMULATOR_HOST")]
)
def test_an_endpoint_that_does_not_answer_is_a_clear_error_within_seconds(monkeypatch, url, variable):
    import socket
    import time

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(variable, f"http://127.0.0.1:{port}")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    start = time.monotonic()
    with pytest.raises(HfBridgeError) as caught:
        hf_bridge.load_pretrained(url)
    assert time.monotonic() - start < 6.5  # gcsfs alone retried for ~34 s
    assert url in str(caught.value) and f"127.0.0.1:{port}" in str(caught.value) and variable in str(caught.value)
