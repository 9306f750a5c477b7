import json

import pytest

from shard_cache.sources import DocumentReader

datasets = pytest.importorskip("datasets", reason="the `hf` extra (datasets) is not installed")


def test_a_local_hugging_face_dataset_directory_is_a_source(tmp_path, monkeypatch, tools):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    docs = tools.make_docs(9, seed=60)
    data = tmp_path / "my_dataset"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in docs))
    reader = DocumentReader(f"hf:{data}@train", text_field="content")
    assert list(reader) == docs
    reader = DocumentReader(f"hf:{data}@train", text_field="text")
    with pytest.raises(Exception, match="no field 'text'"):
        list(reader)
