"""Exports and imports at s3:// and gs:// URLs, against real local servers (moto in server mode, the GCS
emulator) reached only through the standard settings (AWS_*, STORAGE_EMULATOR_HOST); what lands in the bucket
is read back with plain clients (boto3, plain HTTP) and compared byte for byte with a local export."""

import logging
import os
import urllib.parse
import urllib.request

import fsspec
import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from tokenizers import Tokenizer, models, pre_tokenizers

import hf_bridge
from hf_bridge import HfBridgeError
from hf_bridge.sources import url_fs
from lm_models import Gpt2Config

CONFIG = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=3, num_heads=4)


@pytest.fixture(scope="module")
def exported(make_model, tmp_path_factory):
    """A model, its tokenizer and the same export on local disk, to compare the bucket's objects with."""
    model = make_model(CONFIG, 64)
    tokenizer = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "hello": 1, "world": 2}, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    local = tmp_path_factory.mktemp("local") / "export"
    hf_bridge.save_pretrained(model, CONFIG, local, max_shard_size=60_000, tokenizer=tokenizer)
    return model, tokenizer, local


def _plain_get(server, bucket: str, key: str) -> bytes:
    """An object's bytes through the store's own protocol, without fsspec."""
    if server.scheme == "s3":
        import boto3

        client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    quoted = urllib.parse.quote(key, safe="")
    url = f"{os.environ['STORAGE_EMULATOR_HOST']}/download/storage/v1/b/{bucket}/o/{quoted}?alt=media"
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


@pytest.mark.parametrize("store", ["s3_server", "gcs_server"])
def test_export_and_import_at_a_bucket_url(request, store, exported, caplog):
    model, tokenizer, local = exported
    server = request.getfixturevalue(store)
    bucket = server.new_bucket()
    url = server.url(bucket, "exports/gpt2")
    hf_bridge.save_pretrained(model, CONFIG, url, max_shard_size=60_000, tokenizer=tokenizer)

    # The same file system object as hf_bridge's (the same client options): what the test removes below, hf_bridge's
    # cached listing forgets too.
    fs, root = url_fs(url, "export")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert names == sorted(p.name for p in local.iterdir())
    assert "model-00003-of-00003.safetensors" in names and "tokenizer.json" in names
    for name in names:
        assert _plain_get(server, bucket, f"exports/gpt2/{name}") == (local / name).read_bytes(), name

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    with caplog.at_level(logging.INFO, logger="hf_bridge"):
        loaded, config = hf_bridge.load_pretrained(url, mesh=mesh, axis_mapping={"embed": "data", "mlp": "model"})
    assert config == CONFIG
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert loaded.blocks.stacked.mlp.up.weight.array.sharding.spec == jax.sharding.PartitionSpec(None, "model", "data")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("read ")]
    read, total = (int(w) for w in line.split() if w.isdigit())
    assert read == total  # one process: every byte once, in ranged reads of the bucket's objects

    assert hf_bridge.load_tokenizer(url).encode("hello world").ids == [1, 2]
    assert hf_bridge.load_special_tokens(url)["eos_token"] == "<|endoftext|>"
    assert hf_bridge.read_model_config(url, overrides={"scan_layers": False}) == Gpt2Config(
        **{**CONFIG.__dict__, "scan_layers": False}
    )
    with pytest.raises(HfBridgeError, match=r"set model\.type to 'gpt2'"):
        hf_bridge.read_model_config(url, model_type="llama")

    with pytest.raises(HfBridgeError, match="overwrite=True"):
        hf_bridge.save_pretrained(model, CONFIG, url)
    hf_bridge.save_pretrained(model, CONFIG, url, overwrite=True)  # one file now: the shards must go
    fs.invalidate_cache()
    # The old export's shards and tokenizer files are gone: only what this export wrote remains.
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == ["config.json", "model.safetensors"]
    assert hf_bridge.load_pretrained(url)[1] == CONFIG

    # An upload that broke off before its end has no config.json (written last): a clear error, not a model.
    fs.rm_file(f"{root}/config.json")
    with pytest.raises(HfBridgeError, match=r"config.json does not exist.*interrupted: export it again"):
        hf_bridge.load_pretrained(url)


@pytest.mark.parametrize("store", ["s3_server", "gcs_server"])
def test_a_failed_export_to_a_bucket_leaves_no_objects(request, store, exported, monkeypatch):
    import hf_bridge.save

    model, _, _ = exported
    server = request.getfixturevalue(store)
    url = server.url(server.new_bucket(), "failed")

    def storage_lost_a_file(written, files, shown):
        raise HfBridgeError(f"Checking the export after writing it failed: {shown.where(files[0].name)} (test)")

    monkeypatch.setattr(hf_bridge.save, "verify_export", storage_lost_a_file)
    with pytest.raises(HfBridgeError, match=r"failed/model-00001-of-00003\.safetensors"):
        hf_bridge.save_pretrained(model, CONFIG, url, max_shard_size=60_000)
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    assert not fs.exists(root) or fs.ls(root, detail=False) == []


def test_a_missing_bucket_backend_or_object_is_a_clear_error(s3_server):
    url = s3_server.url(s3_server.new_bucket(), "nothing/here")
    with pytest.raises(HfBridgeError, match="does not exist"):
        hf_bridge.load_pretrained(url)
    with pytest.raises(HfBridgeError, match=r"adlfs"):
        hf_bridge.load_pretrained("abfs://container/model")


def test_an_unreachable_s3_endpoint_is_a_clear_error_within_seconds(exported, monkeypatch):
    import socket
    import time

    import s3fs

    model, tokenizer, _ = exported
    with socket.socket() as probe:  # a port that nothing listens on: every connection is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    for name, value in (("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    for name in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS"):
        monkeypatch.delenv(name, raising=False)
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client would still point at another test's server
    try:
        for action in (
            lambda: hf_bridge.save_pretrained(model, CONFIG, "s3://unreachable-bucket/out", tokenizer=tokenizer),
            lambda: hf_bridge.load_pretrained("s3://unreachable-bucket/model"),
            lambda: hf_bridge.check_export_target("s3://unreachable-bucket/out"),
        ):
            start = time.perf_counter()
            with pytest.raises(HfBridgeError) as error:
                action()
            elapsed = time.perf_counter() - start
            message = str(error.value)
            assert "s3://unreachable-bucket/" in message and "AWS_ENDPOINT_URL" in message, message
            assert elapsed < 12, f"{elapsed:.1f} s to give up (botocore's default retries took 24 s)"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
