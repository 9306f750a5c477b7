import pytest
from tokenizers import Tokenizer

from shard_cache import ShardCacheError, train_tokenizer


def test_training_is_deterministic_and_round_trips(tmp_path, tools):
    texts = tools.make_docs(200, seed=50)
    first = train_tokenizer(texts, 500, save_path=tmp_path / "a" / "tokenizer.json")
    second = train_tokenizer(texts, 500)
    assert first.to_str() == second.to_str()
    loaded = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    # a small corpus runs out of merges before 500; the bytes and the special token are always there
    assert 257 < loaded.get_vocab_size() <= 500 and loaded.token_to_id("<|endoftext|>") == 0
    for text in [*texts[:20], "unseen ✓ bytes \x00\t"]:
        assert loaded.decode(loaded.encode(text).ids) == text


def test_training_from_files(tmp_path, tools):
    paths = []
    for i, doc in enumerate(tools.make_docs(30, seed=51)):
        paths.append(tmp_path / f"{i}.py")
        paths[-1].write_text(doc, encoding="utf-8")
    from_files = train_tokenizer(paths, 300)
    from_texts = train_tokenizer([p.read_text(encoding="utf-8") for p in paths], 300)
    assert from_files.to_str() == from_texts.to_str()


def test_bad_arguments_are_explained():
    with pytest.raises(ShardCacheError, match="vocab_size >= 257"):
        train_tokenizer(["abc"], 100)
    with pytest.raises(ShardCacheError, match="the source is empty"):
        train_tokenizer([], 1000)


def test_a_tokenizer_is_never_left_without_its_checksum(tmp_path, tools):
    """The checksum is written before the tokenizer, so a tokenizer on disk always has one: when the checksum
    cannot be written (here its path is a folder), no tokenizer is written either, rather than one that would
    load unchecked; when the tokenizer's own write fails, its checksum goes too."""
    import hashlib

    docs = tools.make_docs(20, seed=52)
    (tmp_path / "a" / "tokenizer.json.sha256" / "in-the-way").mkdir(parents=True)
    with pytest.raises(ShardCacheError, match="cannot write it"):
        train_tokenizer(docs, 300, save_path=tmp_path / "a" / "tokenizer.json")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["tokenizer.json.sha256"]

    (tmp_path / "b" / "tokenizer.json" / "in-the-way").mkdir(parents=True)
    with pytest.raises(ShardCacheError, match="cannot write it"):
        train_tokenizer(docs, 300, save_path=tmp_path / "b" / "tokenizer.json")
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["tokenizer.json"]  # the folder, and no checksum

    written = train_tokenizer(docs, 300, save_path=tmp_path / "ok.json")
    assert (tmp_path / "ok.json.sha256").read_text().strip() == hashlib.sha256(
        (tmp_path / "ok.json").read_bytes()
    ).hexdigest()
    assert written.to_str(pretty=True).encode() == (tmp_path / "ok.json").read_bytes()
