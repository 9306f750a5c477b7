import json

import pytest

from shard_cache.cli import main


def test_build_inspect_verify_from_the_command_line(tmp_path, tokenizer_path, tools, ray_cluster, capsys):
    for s in range(2):
        tools.write_jsonl(tmp_path / f"data_{s + 1}.jsonl", tools.make_docs(7, seed=30 + s))
    out = tmp_path / "cache"
    args = ["build", str(tmp_path / "data_{1..2}.jsonl"), "--tokenizer", str(tokenizer_path), "--out", str(out)]
    assert main([*args, "--chunk-size", "3", "--ray-address", ray_cluster]) == 0
    captured = capsys.readouterr()
    assert "2 shards, 6 chunks, 14 documents" in captured.out
    # the progress bar: input bytes with rate, and documents, tokens and shards alongside
    assert "shard-cache build: 100%" in captured.err and "docs=14" in captured.err and "shards=2/2" in captured.err
    assert main(["inspect", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["finished"] and summary["docs"] == 14 and summary["chunk_size"] == 3
    assert main(["verify", str(out)]) == 0
    assert "ok: 6 chunks checked, 0 problems" in capsys.readouterr().out
    (out / "chunks" / "00000" / "000001.parquet").write_bytes(b"garbage")
    assert main(["verify", str(out)]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "000001.parquet: sha256 differs" in captured.err


def test_errors_are_one_paragraph_and_exit_2(tmp_path, tokenizer_path, capsys):
    code = main(["build", str(tmp_path / "missing.jsonl"), "--tokenizer", str(tokenizer_path), "--out", "x"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("shard-cache build: error: input ") and "no such file" in err
    assert "Traceback" not in err
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a shard-cache cache" in capsys.readouterr().err
    code = main(["build", "x.jsonl", "--tokenizer", str(tmp_path / "nope.json"), "--out", "y"])
    assert code == 2 and "nope.json" in capsys.readouterr().err


def test_train_tokenizer_command(tmp_path, tools, capsys):
    files = []
    for i, doc in enumerate(tools.make_docs(20, seed=40)):
        files.append(tmp_path / f"f{i}.txt")
        files[-1].write_text(doc)
    out = tmp_path / "tok" / "tokenizer.json"
    assert main(["train-tokenizer", *map(str, files), "--vocab-size", "300", "--out", str(out)]) == 0
    assert "vocabulary of 300" in capsys.readouterr().out and out.exists()


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("build", "inspect", "verify", "train-tokenizer"))
