"""Bad input to `lm-train`: one clear paragraph naming the file, key or line, exit code 2, nothing damaged."""

from __future__ import annotations

import socket
import time

import pytest
from cli_checks import assert_clear_error, tree_digest

pytestmark = pytest.mark.slow


def test_missing_config_file(tiny_project, cli):
    result = cli(["run", "nope.yaml"], tiny_project.root)
    assert_clear_error(result, "nope.yaml does not exist")


def test_bad_yaml_names_the_line(tiny_project, cli):
    bad = tiny_project.write_config("bad.yaml", "trainer:\n  num_train_steps: 5\n seed: [1\n")
    assert_clear_error(cli(["run", str(bad)], tiny_project.root), "bad.yaml:3", "not valid YAML")


def test_unknown_key_suggests_the_nearest(tiny_project, cli):
    result = cli(["run", str(tiny_project.config), "--trainer.num_train_step", "3"], tiny_project.root)
    assert_clear_error(result, "--trainer.num_train_step", "Did you mean `trainer.num_train_steps`?")
    typo = tiny_project.write_config("typo.yaml", tiny_project.config.read_text().replace("hidden_dim", "hiden_dim"))
    assert_clear_error(cli(["run", str(typo)], tiny_project.root), "typo.yaml:", "`model.hidden_dim`")


def test_wrong_type_names_the_key(tiny_project, cli):
    result = cli(["run", str(tiny_project.config), "--trainer.train_batch_size", "lots"], tiny_project.root)
    assert_clear_error(result, "trainer.train_batch_size", "lots")


def test_unknown_model_type_lists_the_known_ones(tiny_project, cli):
    result = cli(["run", str(tiny_project.config), "--model.type", "gpt5"], tiny_project.root)
    assert_clear_error(result, "unknown model.type 'gpt5'", "gpt2", "llama")


def test_missing_data_path_names_the_key(tiny_project, cli):
    result = cli(
        ["run", str(tiny_project.config), "--data.train_urls", "[data/missing_*.jsonl]", "--trainer.run_dir", "runs/x"],
        tiny_project.root,
    )
    assert_clear_error(result, "data.train_urls")
    assert not (tiny_project.root / "runs" / "x").exists()


def test_batch_that_does_not_divide_the_devices(tiny_project, cli):
    result = cli(["run", str(tiny_project.config), "--trainer.train_batch_size", "6"], tiny_project.root)
    assert_clear_error(result, "train_batch_size=6", "8 data-parallel devices")


def test_incompatible_checkpoint_is_refused_and_left_intact(tiny_project, cli):
    run_dir = tiny_project.root / "runs" / "shape"
    first = cli(
        ["run", str(tiny_project.config), "--trainer.run_dir", str(run_dir), "--trainer.num_train_steps", "2"],
        tiny_project.root,
    )
    assert first.returncode == 0, first.output[-3000:]
    before = tree_digest(run_dir)
    second = cli(
        ["run", str(tiny_project.config), "--trainer.run_dir", str(run_dir), "--model.hidden_dim", "48"],
        tiny_project.root,
    )
    assert_clear_error(second, "does not fit this config's model", str(run_dir))
    assert tree_digest(run_dir) == before


def test_debug_shows_the_traceback(tiny_project, cli):
    result = cli(["run", "nope.yaml", "--debug"], tiny_project.root)
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_a_directory_given_as_the_config(tiny_project, cli):
    assert_clear_error(cli(["run", str(tiny_project.root)], tiny_project.root), "is a directory, not a config file")


def test_a_bad_tracker_is_refused_before_any_data_is_read(tiny_project, cli):
    result = cli(
        ["run", str(tiny_project.config), "--trainer.tracker", "{type: wandbb}", "--data.cache_dir", "never-made"],
        tiny_project.root,
    )
    assert_clear_error(result, "trainer.tracker", "unknown tracker type 'wandbb'", "Did you mean 'wandb'?")
    assert not (tiny_project.root / "never-made").exists()


def test_sampling_options_are_checked_before_any_model_is_loaded(tiny_project, cli):
    result = cli(["sample", "no-such-checkpoint", "--top-p", "1.5"], tiny_project.root)
    assert_clear_error(result, "--top-p must be in (0, 1]")


def test_a_damaged_newest_checkpoint_is_quarantined_and_the_run_resumes_from_the_one_before(tiny_project, cli):
    import trackers

    run_dir = tiny_project.root / "runs" / "damaged"
    args = ["run", str(tiny_project.config), "--trainer.run_dir", str(run_dir), "--trainer.num_train_steps", "4"]
    first = cli(args, tiny_project.root)
    assert first.returncode == 0, first.output[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "step-2").is_dir() and (checkpoints / "step-4").is_dir()
    losses = {r["step"]: r["train/loss"] for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}
    assert any(step > 2 for step in losses), losses
    # The case of the report: one chunk of the newest checkpoint truncated to 7 bytes.
    chunk = max(
        (p for p in (checkpoints / "step-4" / "arrays").rglob("*") if p.is_file() and "zarr" not in p.name),
        key=lambda p: p.stat().st_size,
    )
    chunk.write_bytes(chunk.read_bytes()[:7])

    second = cli(args, tiny_project.root)
    assert second.returncode == 0, second.output[-3000:]
    assert "Traceback" not in second.output
    assert "step-4.corrupt" in second.stderr and f"resuming from {checkpoints / 'step-2'}" in second.stderr
    assert (checkpoints / "step-4.corrupt").is_dir() and (checkpoints / "step-4").is_dir()
    again = {r["step"]: r["train/loss"] for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}
    assert again == losses  # steps 3-4 retrained from step-2 give the same bits

    # Named explicitly, a damaged checkpoint is an error that names it, and nothing is renamed or written.
    chunk = max(
        (p for p in (checkpoints / "step-4" / "arrays").rglob("*") if p.is_file() and "zarr" not in p.name),
        key=lambda p: p.stat().st_size,
    )
    chunk.write_bytes(chunk.read_bytes()[:7])
    before = tree_digest(run_dir)
    named = cli([*args, "--trainer.load_checkpoint_path", str(checkpoints / "step-4")], tiny_project.root)
    assert_clear_error(named, "trainer.load_checkpoint_path", str(checkpoints / "step-4"))
    assert tree_digest(run_dir) == before


def test_an_empty_corpus_file_is_named(tiny_project, cli):
    (tiny_project.root / "data" / "empty.jsonl").write_text("", encoding="utf-8")
    result = cli(
        ["run", str(tiny_project.config), "--data.train_urls", "[data/empty.jsonl]", "--data.cache_dir", "cache-empty"],
        tiny_project.root,
    )
    assert_clear_error(result, "has no document", "empty.jsonl", "data.train_urls")


def test_a_config_that_is_not_text_is_named(tiny_project, cli):
    binary = tiny_project.root / "model.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    assert_clear_error(cli(["run", str(binary)], tiny_project.root), f"Config file {binary} is not UTF-8 text (byte 0")
    assert binary.read_bytes() == b"\x89PNG\r\n\x1a\n\xff\xfe"


def test_an_output_file_under_a_file_is_refused_before_any_work(tiny_project, cli):
    run = tiny_project.root / "runs" / "plotted"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "train/loss": {5 - s}}}\n' for s in (1, 2, 3)))
    blocker = tiny_project.root / "blocker.txt"
    blocker.write_text("kept", encoding="utf-8")
    commands = [
        ["plot", str(run), "--out", "blocker.txt/plot.png"],
        ["viz", "no-such-checkpoint", "--out", "blocker.txt/sub/page.html"],
        ["harness", "no-such-checkpoint", "--out", "blocker.txt/scores.json"],
    ]
    for command in commands:
        # The checkpoint is never opened: the output is refused first, naming the flag and the file in the way.
        assert_clear_error(cli(command, tiny_project.root), "--out blocker.txt/", "blocker.txt is a file, not a folder")
    (tiny_project.root / "taken.png").mkdir()
    assert_clear_error(cli(["plot", str(run), "--out", "taken.png"], tiny_project.root), "taken.png: that is a folder")
    assert blocker.read_text(encoding="utf-8") == "kept"
    written = cli(["plot", str(run), "--out", "plots/new/plot.png"], tiny_project.root)
    assert written.returncode == 0 and (tiny_project.root / "plots" / "new" / "plot.png").is_file(), written.output


@pytest.mark.parametrize(
    ("command", "needle"),
    [
        (["viz", "no-such-checkpoint", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["harness", "no-such-checkpoint", "--batch-size", "-2"], "--batch-size must be at least 1, got -2"),
        (["harness", "no-such-checkpoint", "--num-fewshot", "-1"], "--num-fewshot must be 0 or more, got -1"),
    ],
)
def test_a_zero_or_negative_count_in_a_flag_is_refused(tiny_project, cli, command, needle):
    assert_clear_error(cli(command, tiny_project.root), needle)


@pytest.mark.parametrize("name", ["gpt2", "meta-llama/Llama-2-7b-hf"])
def test_a_hub_id_as_the_tokenizer_says_how_to_use_a_local_copy(tiny_project, cli, name):
    overrides = ["--data.tokenizer", name, "--data.cache_dir", "hub-cache", "--trainer.run_dir", "runs/hub"]
    result = cli(["run", str(tiny_project.config), *overrides], tiny_project.root)
    assert_clear_error(
        result, f"data.tokenizer: {name!r}", "Hugging Face Hub id", f"hf download {name}", "tokenizer.json"
    )
    assert not (tiny_project.root / "runs" / "hub").exists()
    # A missing file is still just missing: the hint is for names shaped like a Hub repository.
    missing = cli(["run", str(tiny_project.config), "--data.tokenizer", "tok/missing.json"], tiny_project.root)
    assert_clear_error(missing, "data.tokenizer: tok/missing.json does not exist")


def test_wandb_online_without_an_api_key_is_refused_before_any_data_is_read(tiny_project, cli, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(home), "NETRC": str(home / "netrc")}
    env |= {"WANDB_CONFIG_DIR": str(home / "config"), "WANDB_DIR": str(home)}
    args = ["run", str(tiny_project.config), "--trainer.tracker", "{type: wandb, project: p}"]
    args += ["--data.cache_dir", "never-made-wandb", "--trainer.run_dir", "runs/wandb-online"]
    result = cli(args, tiny_project.root, env=env)
    assert_clear_error(
        result, "trainer.tracker", "no API key", "`wandb login`", "WANDB_MODE=offline", "`mode: offline`"
    )
    assert not (tiny_project.root / "never-made-wandb").exists()
    assert not (tiny_project.root / "runs" / "wandb-online").exists()


def test_export_to_an_unreachable_bucket_names_it_within_seconds(tiny_project, cli):
    run_dir = tiny_project.root / "runs" / "to-export"
    trained = cli(
        ["run", str(tiny_project.config), "--trainer.run_dir", str(run_dir), "--trainer.num_train_steps", "2"],
        tiny_project.root,
    )
    assert trained.returncode == 0, trained.output[-3000:]
    with socket.socket() as probe:  # a port that nothing listens on: every connection is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    env["AWS_REGION"] = "us-east-1"
    # The reference, timed in the same test: the same command refused at once for a local folder that is not empty
    # (the same imports and checks, no network), so that a loaded machine's slow start cancels out.
    (tiny_project.root / "occupied").mkdir(exist_ok=True)
    (tiny_project.root / "occupied" / "x").write_text("x", encoding="utf-8")
    start = time.perf_counter()
    local = cli(["export-hf", str(run_dir), "occupied"], tiny_project.root, env=env)
    reference = time.perf_counter() - start
    assert_clear_error(local, "occupied already exists")
    start = time.perf_counter()
    result = cli(["export-hf", str(run_dir), "s3://unreachable-bucket/export"], tiny_project.root, env=env)
    elapsed = time.perf_counter() - start
    assert_clear_error(result, "s3://unreachable-bucket/export", "AWS_ENDPOINT_URL")
    # The destination is tried before the checkpoint is loaded; botocore's default retries alone took 24 s.
    assert elapsed - reference < 15, f"{elapsed:.1f} s to a clear error, {reference:.1f} s without the network"


def test_a_run_dir_under_a_file_is_refused_before_any_data_is_read(tiny_project, cli):
    (tiny_project.root / "taken.txt").write_text("kept", encoding="utf-8")
    args = ["run", str(tiny_project.config), "--trainer.run_dir", "taken.txt/run", "--data.cache_dir", "never-made-rd"]
    assert_clear_error(cli(args, tiny_project.root), "trainer.run_dir: taken.txt/run", "taken.txt is a file")
    assert not (tiny_project.root / "never-made-rd").exists()
    assert (tiny_project.root / "taken.txt").read_text(encoding="utf-8") == "kept"
