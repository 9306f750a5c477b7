"""Checkpoint locations: paths and URLs parse one way, and the standard storage settings become tensorstore's."""

import os
from pathlib import Path

import pytest

import dist_ckpt
from dist_ckpt.location import Location


def test_local_paths_file_urls_and_bucket_urls_parse(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Location.parse("ckpts/step-1") == Location("file", str(tmp_path / "ckpts/step-1"))
    assert Location.parse(Path("ckpts")) == Location("file", str(tmp_path / "ckpts"))
    assert Location.parse(f"file://{tmp_path}/c").public() == tmp_path / "c"
    s3 = Location.parse("s3://bkt/runs//a/checkpoints/")
    assert (s3.scheme, s3.bucket, s3.path, str(s3)) == (
        "s3",
        "bkt",
        "runs/a/checkpoints",
        "s3://bkt/runs/a/checkpoints",
    )
    assert str(s3.child("step-3")) == "s3://bkt/runs/a/checkpoints/step-3"
    assert str(s3.child("step-3").sibling("step-3.corrupt")) == "s3://bkt/runs/a/checkpoints/step-3.corrupt"
    assert str(Location.parse("gs://bkt").child("step-1")) == "gs://bkt/step-1"
    assert Location.parse("gs://bkt").kvstore_spec()["path"] == ""


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("hdfs://nn/ckpt", r"scheme hdfs://.*s3://bucket/prefix"),
        ("s3:///no-bucket", r"names no bucket"),
        (Path("s3://bucket/run"), r"went through pathlib.Path.*Pass URLs as strings"),
    ],
)
def test_unsupported_urls_get_a_clear_error(url, message):
    with pytest.raises(ValueError, match=message):
        dist_ckpt.latest(url)


def test_aws_settings_become_the_s3_spec(monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID"):
        monkeypatch.delenv(name, raising=False)
    assert Location.parse("s3://b/p").kvstore_spec("step-1") == {"driver": "s3", "bucket": "b", "path": "p/step-1/"}
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    assert Location.parse("s3://b/p").kvstore_spec()["aws_region"] == "eu-west-3"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000/")
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    spec = Location.parse("s3://b/p").kvstore_spec()
    assert (spec["endpoint"], spec["aws_region"]) == ("http://127.0.0.1:9000", "us-west-2")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3.local:9001")  # the service-specific one wins
    assert Location.parse("s3://b/p").kvstore_spec()["endpoint"] == "http://s3.local:9001"


def test_keys_in_the_environment_are_the_s3_credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    only_the_environment = {"aws_credentials": {"type": "environment"}}
    assert Location.parse("s3://b/p").kvstore_spec()["context"] == only_the_environment
    monkeypatch.setenv("AWS_PROFILE", "work")  # a named profile: the SDK's own chain finds it
    assert "context" not in Location.parse("s3://b/p").kvstore_spec()
    monkeypatch.delenv("AWS_PROFILE")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")  # half the keys: the chain looks elsewhere, as before
    assert "context" not in Location.parse("s3://b/p").kvstore_spec()


def test_storage_emulator_host_becomes_tensorstores_gcs_url(monkeypatch):
    monkeypatch.setattr("dist_ckpt.location._gcs_url_we_set", None)  # restored after the test, with the variables
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", "unset")  # records its state now, which teardown restores
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "localhost:4443")
    assert Location.parse("gs://b/p").kvstore_spec() == {"driver": "gcs", "bucket": "b", "path": "p/"}
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://localhost:4443"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "https://gcs.test:8443/")  # followed when it changes
    Location.parse("gs://b/p").kvstore_spec()
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "https://gcs.test:8443"
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", "http://mine:1")  # a user's own setting is kept
    Location.parse("gs://b/p").kvstore_spec()
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://mine:1"


def test_retry_policy_bounds_and_tensorstore_context():
    policy = dist_ckpt.RetryPolicy(max_attempts=4, initial_delay=0.5, max_delay=1.5)
    assert policy.bound_seconds == 0.5 + 1.0 + 1.5
    spec = policy.context_spec()
    assert spec["s3_request_retries"] == {"max_retries": 4, "initial_delay": "0.5s", "max_delay": "1.5s"}
    assert spec["gcs_request_retries"] == spec["s3_request_retries"]
    with pytest.raises(ValueError, match="not a retry policy"):
        dist_ckpt.RetryPolicy(max_attempts=0)
    previous = dist_ckpt.set_retry_policy(policy)
    try:
        assert dist_ckpt.retry_policy() is policy
    finally:
        dist_ckpt.set_retry_policy(previous)


def test_one_retry_policy_and_one_storage_error_for_every_package(tmp_path):
    """dist_ckpt's policy is storage_io's (shard-cache and hf-bridge retry by it too); its StorageError is one."""
    import storage_io

    policy = dist_ckpt.RetryPolicy(max_attempts=3, initial_delay=0.1, max_delay=0.2)
    previous = dist_ckpt.set_retry_policy(policy)
    try:
        assert storage_io.retry_policy() is policy
    finally:
        dist_ckpt.set_retry_policy(previous)
    (tmp_path / "notes").write_text("a file where the checkpoint's parent should be")
    with pytest.raises(storage_io.StorageError) as caught:
        dist_ckpt.save({"x": 1}, tmp_path / "notes" / "step-1", step=1)
    assert isinstance(caught.value, dist_ckpt.StorageError)
    assert caught.value.location == caught.value.url == str(tmp_path / "notes" / "step-1")
