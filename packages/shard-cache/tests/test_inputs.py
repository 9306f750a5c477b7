import gzip

import pytest

from shard_cache import BadInputError, expand_inputs
from shard_cache.inputs import expand_braces, group_into_shards


def test_brace_ranges_keep_zero_padding_and_alternatives():
    assert expand_braces("d_{1..3}.jsonl") == ["d_1.jsonl", "d_2.jsonl", "d_3.jsonl"]
    assert expand_braces("d_{08..10}") == ["d_08", "d_09", "d_10"]
    assert expand_braces("{a,b}_{1..2}") == ["a_1", "a_2", "b_1", "b_2"]


def test_globs_and_ranges_expand_to_sorted_files(tmp_path):
    for name in ["b.jsonl", "a.jsonl", "c.txt"]:
        (tmp_path / name).write_text("{}\n")
    assert expand_inputs([str(tmp_path / "*.jsonl")]) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert expand_inputs(str(tmp_path / "{b,c}.*")) == [str(tmp_path / "b.jsonl"), str(tmp_path / "c.txt")]


def test_memory_urls_are_inputs_too():
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/inputs/x1.jsonl.gz", gzip.compress(b'{"text": "hi"}\n'))
    fs.pipe("/inputs/x2.jsonl.gz", gzip.compress(b'{"text": "ho"}\n'))
    assert expand_inputs("memory://inputs/x{1..2}.jsonl.gz") == [
        "memory://inputs/x1.jsonl.gz",
        "memory://inputs/x2.jsonl.gz",
    ]
    assert expand_inputs("memory://inputs/*.gz") == ["memory:///inputs/x1.jsonl.gz", "memory:///inputs/x2.jsonl.gz"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: str(p / "missing.jsonl"), "no such file"),
        (lambda p: str(p / "nothing_*.jsonl"), "matches no file"),
        (lambda p: str(p), "is a directory"),
        (lambda p: "nosuchproto://bucket/x.jsonl", "not a path or a known fsspec URL"),
    ],
)
def test_unusable_inputs_fail_early_naming_the_input(tmp_path, make, message):
    url = make(tmp_path)
    with pytest.raises(BadInputError, match=message) as info:
        expand_inputs([url])
    assert url in str(info.value)


def test_files_group_into_shards():
    shards = group_into_shards([f"f{i}" for i in range(5)], files_per_shard=2)
    assert [s.files for s in shards] == [("f0", "f1"), ("f2", "f3"), ("f4",)]
    assert shards[0].name == "f0 (+1 files)"
