import pyarrow as pa
from tokenizers import Tokenizer, processors

from shard_cache import TokenizerProcessor, build_cache, open_cache


def test_exactly_one_eos_even_when_the_tokenizer_appends_its_own(tokenizer_path, tools):
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos = tokenizer.token_to_id("<|endoftext|>")
    # a post-processor that already appends EOS: encoding with special tokens would double it
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)]
    )
    docs = tools.make_docs(12, seed=70)
    batch = TokenizerProcessor(tokenizer)(docs)
    assert isinstance(batch, pa.RecordBatch) and batch.schema.field("input_ids").type == pa.list_(pa.int32())
    rows = batch.column("input_ids").to_pylist()
    assert rows == tools.reference_ids(tokenizer, docs)
    assert all(row.count(eos) == 1 and row[-1] == eos for row in rows)


def test_optional_bos_goes_first(tokenizer_path, tools):
    processor = TokenizerProcessor(str(tokenizer_path), bos_token="<|endoftext|>", add_bos=True)
    docs = tools.make_docs(3, seed=71)
    rows = processor(docs).column("input_ids").to_pylist()
    plain = TokenizerProcessor(str(tokenizer_path))(docs).column("input_ids").to_pylist()
    assert rows == [[processor.bos_id, *row] for row in plain]


def test_hf_tokenizer_directory_gives_its_eos(tmp_path, tokenizer_path):
    directory = tmp_path / "hf_tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes(tokenizer_path.read_bytes())
    (directory / "tokenizer_config.json").write_text('{"eos_token": {"content": "<|endoftext|>"}}')
    assert TokenizerProcessor(str(directory)).eos_token == "<|endoftext|>"


def test_many_small_files_as_one_document_each_grouped_into_shards(tmp_path, tokenizer, tools, tokenizer_path):
    docs = tools.make_docs(23, seed=72)
    files = []
    for i, doc in enumerate(docs):
        files.append(tmp_path / "src" / f"mod_{i:02d}.py")
        files[-1].parent.mkdir(exist_ok=True)
        files[-1].write_text(doc, encoding="utf-8")
    (tmp_path / "src" / "mod_99.py").write_text("")  # an empty __init__.py-like file, skipped and counted
    result = build_cache(
        [str(tmp_path / "src" / "*.py")],
        str(tmp_path / "cache"),
        tokenizer=str(tokenizer_path),
        fmt="text",
        files_per_shard=5,
        chunk_size=2,
        on_bad_input="skip",
        progress=False,
    )
    assert result.shards == 5 and result.docs == 23 and result.skipped == {"empty": 1}
    # 24 files dealt round-robin into 5 shards: shard s holds files s, s + 5, ...; mod_99 (the 24th) is empty
    shard_docs = [[docs[i] for i in range(s, 23, 5)] for s in range(5)]
    expected = tools.reference_ids(tokenizer, tools.round_robin_docs(shard_docs, 2))
    got = open_cache(str(tmp_path / "cache")).documents().get(range(23))
    assert [g.tolist() for g in got] == expected
