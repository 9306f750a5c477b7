import json
import typing

from shard_cache.cli import RecordFormat, main
from shard_cache.formats import RECORD_FORMATS


def test_build_inspect_verify_repair_from_the_command_line(tmp_path, tokenizer_path, tools, ray_cluster, capsys):
    for s in range(2):
        tools.write_jsonl(tmp_path / f"data_{s + 1}.jsonl", tools.make_docs(7, seed=30 + s))
    (tmp_path / "data_3.jsonl").write_text("")
    out = tmp_path / "cache"
    args = ["build", str(tmp_path / "data_{1..3}.jsonl"), "--tokenizer", str(tokenizer_path), "--out", str(out)]
    assert main([*args, "--chunk-size", "3", "--ray-address", ray_cluster]) == 0
    captured = capsys.readouterr()
    assert "3 shards, 6 chunks, 14 documents" in captured.out
    # Not a terminal: plain progress lines, none repeated, the last one at 100% with every count.
    lines = [line for line in captured.err.splitlines() if line.startswith("shard-cache build: ")]
    assert lines and len(lines) == len(set(lines)), captured.err
    assert lines[-1].startswith("shard-cache build: 100% · 3/3 shards · 14 docs · ") and "tokens/s" in lines[-1]
    # The empty input is named once.
    assert captured.err.count(f"{tmp_path / 'data_3.jsonl'}: gave no document") == 1
    assert main(["inspect", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["finished"] and summary["docs"] == 14 and summary["chunk_size"] == 3
    assert summary["empty_inputs"] == [str(tmp_path / "data_3.jsonl")] and summary["chunk_checksums"] == "crc32c"
    assert main(["verify", str(out), "--no-progress"]) == 0
    assert "ok: 6 chunks checked, 0 problems" in capsys.readouterr().out
    victim = out / "chunks" / "00000" / "000001.parquet"
    good = victim.read_bytes()
    victim.write_bytes(b"garbage")
    assert main(["verify", str(out)]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "000001.parquet: its CRC-32C differs from the ledger's" in captured.err
    assert "--repair --tokenizer" in captured.err and "Traceback" not in captured.err
    assert main(["verify", str(out), "--repair"]) == 2  # --repair needs the tokenizer
    assert capsys.readouterr().err.startswith("error: --repair needs --tokenizer")
    assert main(["verify", str(out), "--repair", "--tokenizer", str(tokenizer_path), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert f"repaired: {victim}" in captured.err and "ok: 6 chunks checked" in captured.out
    assert victim.read_bytes() == good


def test_errors_are_one_paragraph_and_exit_2(tmp_path, tokenizer_path, capsys):
    code = main(["build", str(tmp_path / "missing.jsonl"), "--tokenizer", str(tokenizer_path), "--out", "x"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: input ") and "no such file" in err and len(err.splitlines()) == 1
    assert "Traceback" not in err
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a shard-cache cache" in err
    code = main(["build", "x.jsonl", "--tokenizer", str(tmp_path / "nope.json"), "--out", "y"])
    assert code == 2 and "nope.json" in capsys.readouterr().err
    # usage errors, as lm-train's: exit 2 with Typer's message
    assert main(["build", "x.jsonl", "--tokenizer", "t", "--out", "y", "--chunk-size", "many"]) == 2
    assert "Invalid value for '--chunk-size'" in capsys.readouterr().err
    assert main(["build", "x.jsonl", "--tokenizer", "t", "--out", "y", "--format", "xml"]) == 2
    assert main(["build", "x.jsonl", "--tokenizer", "t", "--out", "y", "--record-format", "dpo"]) == 2
    assert "Invalid value for '--record-format'" in capsys.readouterr().err
    assert main(["verify"]) == 2
    assert "Missing argument 'DIR'" in capsys.readouterr().err


def test_train_tokenizer_command(tmp_path, tools, capsys):
    files = []
    for i, doc in enumerate(tools.make_docs(20, seed=40)):
        files.append(tmp_path / f"f{i}.txt")
        files[-1].write_text(doc)
    out = tmp_path / "tok" / "tokenizer.json"
    assert main(["train-tokenizer", *map(str, files), "--vocab-size", "300", "--out", str(out)]) == 0
    assert "vocabulary of 300" in capsys.readouterr().out and out.exists()
    assert (tmp_path / "tok" / "tokenizer.json.sha256").exists()


def test_help_has_lm_trains_layout_and_lists_every_command_and_flag(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: shard-cache [OPTIONS] COMMAND [ARGS]..." in out and "╭─ Commands" in out
    assert all(name in out for name in ("build", "inspect", "verify", "train-tokenizer"))
    assert main(["build", "-h"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--tokenizer",
        "--out",
        "--format",
        "--text-field",
        "--chunk-size",
        "--files-per-shard",
        "--num-workers",
        "--ray-address",
        "--on-bad-input",
        "--eos",
        "--bos",
        "--add-bos",
        "--no-progress",
        "--debug",
    ):
        assert flag in out, flag
    assert main([]) == 2  # no command: the help, as lm-train


def test_record_format_choices_are_the_package_formats():
    # The CLI spells the choices out (its --help imports no processor); they must stay the formats that exist.
    choices = typing.get_args(RecordFormat)[0]
    assert typing.get_args(choices) == RECORD_FORMATS
