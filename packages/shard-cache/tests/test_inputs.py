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
    # dealt round-robin, so that neighbouring (often similar) files land in different shards
    assert [s.files for s in shards] == [("f0", "f3"), ("f1", "f4"), ("f2",)]
    assert shards[0].name == "f0 (+1 files)" and shards[2].name == "f2"
    assert [s.files for s in group_into_shards(["a", "b"])] == [("a",), ("b",)]


def test_a_cache_of_consecutively_grouped_files_is_refused_with_the_reason(tmp_path, tokenizer_path):
    """A cache that shard-cache 0.3 or older built with files_per_shard (consecutive groups): 0.4 will not resume it."""
    from shard_cache import CacheMismatchError, TokenizerProcessor, build_cache
    from shard_cache.build import BuildOptions, _settings, _settings_bytes
    from shard_cache.inputs import Shard

    files = []
    for i in range(4):
        files.append(tmp_path / f"f{i}.txt")
        files[-1].write_text(f"document {i}")
    consecutive = [
        Shard(str(files[0]), (str(files[0]), str(files[1]))),
        Shard(str(files[2]), (str(files[2]), str(files[3]))),
    ]
    old = _settings(consecutive, TokenizerProcessor(str(tokenizer_path)), BuildOptions(fmt="text", files_per_shard=2))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "cache.json").write_bytes(_settings_bytes(old))
    with pytest.raises(CacheMismatchError, match="the same files are grouped into shards differently"):
        build_cache([str(f) for f in files], str(tmp_path / "cache"), tokenizer=str(tokenizer_path), fmt="text",
                    files_per_shard=2, progress=False)  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["cache.json"]  # nothing else written


def test_the_regrouping_reason_is_given_only_for_a_consecutive_grouping_of_the_same_files(tmp_path, tokenizer_path):
    """Inputs given in another order (one file per shard) change the shards too, but not by 0.4's dealing."""
    from shard_cache import CacheMismatchError, TokenizerProcessor, build_cache
    from shard_cache.build import BuildOptions, _settings, _settings_bytes

    files = []
    for i in range(4):
        files.append(str(tmp_path / f"f{i}.txt"))
        (tmp_path / f"f{i}.txt").write_text(f"document {i}")
    built = _settings(group_into_shards(files), TokenizerProcessor(str(tokenizer_path)), BuildOptions(fmt="text"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "cache.json").write_bytes(_settings_bytes(built))
    with pytest.raises(CacheMismatchError, match=r"'shards' was \[\{'files'") as info:
        build_cache(files[::-1], str(tmp_path / "cache"), tokenizer=str(tokenizer_path), fmt="text", progress=False)
    assert "grouped into shards differently" not in str(info.value)
