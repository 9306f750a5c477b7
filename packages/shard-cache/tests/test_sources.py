import bz2
import gzip
import json
import lzma

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from shard_cache import BadInputError
from shard_cache.sources import DocumentReader

DOCS = ["first document", "second one\nwith two lines", "third: ünïcödé"]


def jsonl_bytes(docs, field="text"):
    return "".join(json.dumps({field: d}) + "\n" for d in docs).encode("utf-8")


@pytest.mark.parametrize(
    ("suffix", "compress"),
    [
        ("", lambda b: b),
        (".gz", gzip.compress),
        (".zst", lambda b: zstandard.ZstdCompressor().compress(b)),
        (".zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
        (".bz2", bz2.compress),
        (".xz", lzma.compress),
    ],
)
def test_jsonl_in_every_compression(tmp_path, suffix, compress):
    path = tmp_path / f"docs.jsonl{suffix}"
    path.write_bytes(compress(jsonl_bytes(DOCS)))
    reader = DocumentReader(str(path))
    assert list(reader) == DOCS
    assert reader.bytes_read == path.stat().st_size


def test_text_per_file_per_line_and_parquet(tmp_path):
    (tmp_path / "whole.txt").write_text("line one\nline two\n", encoding="utf-8")
    assert list(DocumentReader(str(tmp_path / "whole.txt"))) == ["line one\nline two\n"]
    assert list(DocumentReader(str(tmp_path / "whole.txt"), fmt="lines")) == ["line one", "line two"]
    pq.write_table(pa.table({"content": DOCS}), tmp_path / "d.parquet")
    assert list(DocumentReader(str(tmp_path / "d.parquet"), text_field="content")) == DOCS
    (tmp_path / "f.jsonl").write_bytes(jsonl_bytes(DOCS, field="body"))
    assert list(DocumentReader(str(tmp_path / "f.jsonl"), text_field="body")) == DOCS


BAD_CASES = [
    # (file name, bytes, expected reason, text that the error must contain)
    ("bad.jsonl", b'{"text": "ok"}\n{"text": "b\n{"text": "fine"}\n', "malformed_json", "bad.jsonl:2: malformed"),
    ("nofield.jsonl", b'{"text": "ok"}\n{"body": "x"}\n', "missing_field", "nofield.jsonl:2: no field 'text'"),
    ("latin.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "not_utf8", "latin.jsonl:2: bytes that are not valid"),
    ("empty.jsonl", b'{"text": "ok"}\n{"text": "  "}\n', "empty", "empty.jsonl:2: empty document"),
    ("num.jsonl", b'{"text": "ok"}\n{"text": 7}\n', "not_a_string", "num.jsonl:2: field 'text' holds a int"),
    ("list.jsonl", b'{"text": "ok"}\n[1, 2]\n', "not_an_object", "list.jsonl:2: the line is a JSON list"),
    ("lines.txt", b"ok\n\xff\xfe\n", "not_utf8", "lines.txt:2: bytes that are not valid UTF-8"),
]


@pytest.mark.parametrize(("name", "data", "reason", "message"), BAD_CASES)
def test_bad_documents_fail_naming_file_and_line(tmp_path, name, data, reason, message):
    path = tmp_path / name
    path.write_bytes(data)
    fmt = "lines" if name.endswith(".txt") else "auto"
    with pytest.raises(BadInputError) as info:
        list(DocumentReader(str(path), fmt=fmt))
    assert message in str(info.value)
    assert "on_bad_input='skip'" in str(info.value)


@pytest.mark.parametrize(("name", "data", "reason", "message"), BAD_CASES)
def test_bad_documents_are_skipped_and_counted(tmp_path, name, data, reason, message):
    path = tmp_path / name
    path.write_bytes(data)
    fmt = "lines" if name.endswith(".txt") else "auto"
    reader = DocumentReader(str(path), fmt=fmt, on_bad_input="skip")
    docs = list(reader)
    assert docs[0] == "ok"
    assert dict(reader.skipped) == {reason: 1}


def test_whole_file_errors_name_the_file(tmp_path):
    pq.write_table(pa.table({"content": DOCS}), tmp_path / "d.parquet")
    with pytest.raises(BadInputError, match=r"d.parquet: no column 'text' \(columns: content\)"):
        list(DocumentReader(str(tmp_path / "d.parquet")))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(DOCS))[:-12])
    with pytest.raises(BadInputError, match=r"cut\.jsonl\.gz: cannot decompress or read it"):
        list(DocumentReader(str(tmp_path / "cut.jsonl.gz")))
    with pytest.raises(BadInputError, match=r"gone\.jsonl: cannot open it"):
        list(DocumentReader(str(tmp_path / "gone.jsonl")))
    (tmp_path / "bad_utf8.txt").write_bytes(b"line\nline\nbad \xc3\x28 here\n")
    with pytest.raises(BadInputError, match=r"bad_utf8\.txt:3: bytes that are not valid UTF-8"):
        list(DocumentReader(str(tmp_path / "bad_utf8.txt")))
