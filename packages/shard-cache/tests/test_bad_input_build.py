import json

import pytest

from shard_cache import (
    BadInputError,
    ShardCacheError,
    TokenizerProcessor,
    build_cache,
    inspect_cache,
    open_cache,
    verify_cache,
)


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def test_failing_build_keeps_what_it_committed_and_resumes_after_the_fix(tmp_path, tokenizer_path, tools):
    docs = tools.make_docs(40, seed=5)
    lines = [json.dumps({"text": d}) for d in docs]
    good = lines.copy()
    lines[30] = '{"text": "unterminated'
    source = tmp_path / "data.jsonl"
    write_lines(source, lines)
    out = tmp_path / "cache"
    with pytest.raises(BadInputError) as info:
        build_cache([str(source)], str(out), tokenizer=str(tokenizer_path), chunk_size=5, progress=False)
    message = str(info.value)
    assert message.startswith(f"{source}:31: malformed JSON") and "--on-bad-input skip" in message
    assert "Traceback" not in message
    summary = inspect_cache(str(out))
    assert summary["chunks"] == 6 and summary["docs"] == 30 and not summary["finished"]
    assert summary["error"].startswith("BadInputError: ") and ":31: malformed JSON" in summary["error"]
    assert verify_cache(str(out)).ok and not (out / ".locks").exists()
    windows = open_cache(str(out)).token_windows(4)
    with pytest.raises(ShardCacheError, match=r"the build stopped: BadInputError: .*data\.jsonl:31"):
        windows.get_batch([10**6], timeout=60)  # a reader fails at once instead of waiting for the timeout
    write_lines(source, good)  # the fix; the rerun resumes after the 6 committed chunks
    build_cache([str(source)], str(out), tokenizer=str(tokenizer_path), chunk_size=5, progress=False)
    fresh = tmp_path / "fresh"
    build_cache([str(source)], str(fresh), tokenizer=str(tokenizer_path), chunk_size=5, progress=False)
    assert tools.tree_bytes(out) == tools.tree_bytes(fresh)


def test_skip_policy_counts_each_kind_of_bad_document(tmp_path, tokenizer_path, tokenizer, tools):
    docs = tools.make_docs(6, seed=6)
    source = tmp_path / "mixed.jsonl"
    source.write_bytes(
        b"".join(
            [
                json.dumps({"text": docs[0]}).encode() + b"\n",
                b'{"text": oops}\n',
                json.dumps({"text": docs[1]}).encode() + b"\n",
                b'{"body": "no text field"}\n',
                b'{"text": "caf\xe9"}\n',
                b'{"text": ""}\n',
                json.dumps({"text": docs[2]}).encode() + b"\n",
            ]
        )
    )
    out = tmp_path / "cache"
    result = build_cache([str(source)], str(out), tokenizer=str(tokenizer_path), on_bad_input="skip", progress=False)
    assert result.docs == 3
    assert result.skipped == {"empty": 1, "malformed_json": 1, "missing_field": 1, "not_utf8": 1}
    assert inspect_cache(str(out))["skipped"] == result.skipped
    got = [d.tolist() for d in open_cache(str(out)).documents().get([0, 1, 2])]
    assert got == tools.reference_ids(tokenizer, docs[:3])


def test_unreachable_input_fails_before_anything_is_written(tmp_path, tokenizer_path):
    out = tmp_path / "cache"
    for url in ["memory://no-such-bucket/data.jsonl", str(tmp_path / "absent-{1..2}.jsonl")]:
        with pytest.raises(BadInputError, match="no such file"):
            build_cache([url], str(out), tokenizer=str(tokenizer_path), progress=False)
    with pytest.raises(BadInputError, match=r"http://127\.0\.0\.1:9/x\.jsonl"):
        build_cache(["http://127.0.0.1:9/x.jsonl"], str(out), tokenizer=str(tokenizer_path), progress=False)
    assert not out.exists()


def test_a_processor_returning_the_wrong_rows_is_named(tmp_path, tokenizer_path, tools):
    tools.write_jsonl(tmp_path / "d.jsonl", tools.make_docs(4, seed=7))

    class DropsOne(TokenizerProcessor):
        def __call__(self, docs):
            return super().__call__(docs).slice(1)

    with pytest.raises(ShardCacheError, match="returned RecordBatch of 3 rows for 4 documents"):
        build_cache(
            [str(tmp_path / "d.jsonl")], str(tmp_path / "c"), processor=DropsOne(str(tokenizer_path)), progress=False
        )


def test_eos_must_be_known(tmp_path):
    from tokenizers import Tokenizer, models

    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ShardCacheError, match=r"Pass eos_token= \(CLI: --eos\)"):
        TokenizerProcessor(bare)
    with pytest.raises(ShardCacheError, match="has no EOS token '</s>'"):
        TokenizerProcessor(bare, eos_token="</s>")
