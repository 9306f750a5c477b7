"""End to end with the real CLI: train, rerun to resume, kill -9 and resume bitwise, eval and sample."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import time
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest

import dist_ckpt
import trackers

pytestmark = pytest.mark.slow
RUN_UMASK = 0o027


def model_leaves(checkpoint: Path | str) -> dict[str, np.ndarray]:
    """Every model parameter of a checkpoint, read as plain numpy."""
    flat = dist_ckpt.load(checkpoint, progress=False)
    return {k: v for k, v in flat.items() if k.startswith(".model")}


def assert_bitwise_equal(a: Path | str, b: Path | str) -> None:
    left, right = model_leaves(a), model_leaves(b)
    assert left.keys() == right.keys() and left
    for key in left:
        assert left[key].dtype == right[key].dtype, key
        assert left[key].tobytes() == right[key].tobytes(), f"{key} differs between {a} and {b}"


@pytest.fixture(scope="module")
def reference_run(tiny_project, cli):
    """An uninterrupted run of the tiny config, the reference for the determinism tests, under a umask that keeps
    its files from others but not from the group (a shared cluster's usual setting)."""
    args = ["run", str(tiny_project.config), "--trainer.run_dir", "runs/reference"]
    result = cli(args, tiny_project.root, umask=RUN_UMASK)
    assert result.returncode == 0, result.output[-5000:]
    return tiny_project.root / "runs" / "reference"


def test_run_writes_the_run_directory(reference_run):
    assert (reference_run / "config.yaml").exists() and (reference_run / "tokenizer.json").exists()
    rows = trackers.read_jsonl(reference_run / "metrics.jsonl")
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == [2, 4, 6, 8, 10, 12]
    for key in ("optim/learning_rate", "optim/grad_norm", "throughput/tokens_per_second", "throughput/mfu"):
        assert key in rows[0]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [6, 12]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < losses[0]
    assert dist_ckpt.latest(reference_run / "checkpoints").name == "step-12"
    # Every artifact (config, tokenizer, metrics, checkpoints, HF export) has the modes the umask gives.
    wrong = [
        f"{path.relative_to(reference_run)}: {oct(path.stat().st_mode & 0o777)}"
        for path in [reference_run, *reference_run.rglob("*")]
        if path.stat().st_mode & 0o777 != (0o777 if path.is_dir() else 0o666) & ~RUN_UMASK
    ]
    assert {p.name for p in reference_run.iterdir()} >= {"checkpoints", "hf", "metrics.jsonl"}
    assert wrong == []


def test_same_config_twice_gives_identical_parameters(tiny_project, reference_run, cli):
    again = cli(["run", str(tiny_project.config), "--trainer.run_dir", "runs/again"], tiny_project.root)
    assert again.returncode == 0, again.output[-5000:]
    # The same program, already compiled once this session: loaded from JAX's persistent cache, same bits.
    assert "train step: loaded from the compilation cache in" in again.stderr, again.stderr[-3000:]
    # Rerun once finished: it says so and stops, with no hyperparameter table, bar, step or new metrics.
    metrics = (tiny_project.root / "runs/again/metrics.jsonl").read_text(encoding="utf-8")
    done = cli(["run", str(tiny_project.config), "--trainer.run_dir", "runs/again"], tiny_project.root)
    assert done.returncode == 0, done.output[-3000:]
    assert "is already at step 12 of 12: nothing to train" in done.stderr
    assert "hyperparameters" not in done.output and "12/12" not in done.output
    assert (tiny_project.root / "runs/again/metrics.jsonl").read_text(encoding="utf-8") == metrics
    assert_bitwise_equal(
        reference_run / "checkpoints" / "step-12", tiny_project.root / "runs/again/checkpoints/step-12"
    )


def start_slow_run(tiny_project, run_dir: Path, command: list[str], config: Path | None = None) -> subprocess.Popen:
    """A run whose steps are slowed on the host, so that a signal lands mid-run."""
    env = dict(os.environ, LM_TRAIN_STEP_DELAY_S="0.4")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    return subprocess.Popen(
        [*command, "run", str(config or tiny_project.config), "--trainer.run_dir", str(run_dir)],
        cwd=tiny_project.root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def wait_for_checkpoint(process: subprocess.Popen, checkpoints: Path | str, name: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with warnings.catch_warnings():  # a checkpoint being written right now is "torn" until committed
            warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)
            latest = dist_ckpt.latest(checkpoints)
        if latest is not None and str(latest).rstrip("/").endswith("/" + name):
            return
        time.sleep(0.05)
    if process.poll() is not None:
        pytest.fail("the run ended before the signal: " + process.stderr.read().decode()[-3000:])
    pytest.fail(f"no {name} under {checkpoints} within {timeout} s")


def test_sigterm_saves_and_rerun_resumes_bitwise(tiny_project, reference_run, cli, lm_train_command):
    run_dir = tiny_project.root / "runs" / "preempted"
    process = start_slow_run(tiny_project, run_dir, lm_train_command)
    try:
        wait_for_checkpoint(process, run_dir / "checkpoints", "step-2")
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    # 128 + SIGTERM, as a shell reports a job ended by the signal: a scheduler must not take it for finished.
    assert process.returncode == 128 + signal.SIGTERM, stderr.decode()[-3000:]
    assert "rerun the same command to resume" in stderr.decode()
    stopped_at = dist_ckpt.latest(run_dir / "checkpoints")
    assert stopped_at.name != "step-12"
    second = cli(["run", str(tiny_project.config), "--trainer.run_dir", str(run_dir)], tiny_project.root)
    assert second.returncode == 0, second.output[-5000:]
    assert f"resuming from {stopped_at}" in second.output
    assert_bitwise_equal(reference_run / "checkpoints/step-12", run_dir / "checkpoints/step-12")
    rows = trackers.read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == [2, 4, 6, 8, 10, 12]
    # The keep policy (every 2) makes the even steps permanent; a checkpoint written at the signal on an odd step
    # is temporary, and is deleted once a newer one is complete, as the docs say.
    left = sorted((p.name for p in (run_dir / "checkpoints").iterdir()), key=lambda n: int(n.split("-")[1]))
    assert left == [f"step-{n}" for n in range(2, 13, 2)], left


def ctrl_c_config(tiny_project) -> Path:
    """The tiny config with steps slow enough on the device for a signal to land mid-run, logged only at the end:
    no log step's fetch then bounds how far the host dispatches steps ahead of the device, only the loop does."""
    text = tiny_project.config.read_text(encoding="utf-8")
    text = text.replace("hidden_dim: 32", "hidden_dim: 128").replace("num_layers: 2", "num_layers: 4")
    text = text.replace("seq_len: 32", "seq_len: 128")
    text = text.replace('validation_urls: ["data/valid.jsonl"]', "validation_urls: []")
    text = text.replace("num_train_steps: 12", "num_train_steps: 30").replace(
        "train_batch_size: 8", "train_batch_size: 32"
    )
    return tiny_project.write_config(
        "ctrl_c.yaml", text.replace("log_every: 2", "log_every: 30").replace("every: 2", "every: 30")
    )


class TerminalOutput:
    """What a command writes to its pseudo-terminal, read as it comes (a full terminal would stall the command)."""

    def __init__(self, master: int):
        self.master, self.text = master, ""

    def read(self, seconds: float) -> None:
        if select.select([self.master], [], [], seconds)[0]:
            try:
                self.text += os.read(self.master, 1 << 16).decode("utf-8", "replace")
            except OSError:  # the command has ended and closed the terminal
                time.sleep(seconds)

    def steps_done(self, total: int) -> int:
        """The completed steps that the progress bar shows last (it counts a step once its loss is computed)."""
        shown = re.findall(rf"\b(\d+)/{total}\b", self.text)
        return int(shown[-1]) if shown else 0


def test_ctrl_c_finishes_the_step_in_flight_saves_exits_130_and_the_rerun_resumes_bitwise(
    tiny_project, cli, lm_train_command
):
    config = ctrl_c_config(tiny_project)
    whole = cli(["run", str(config), "--trainer.run_dir", "runs/ctrl-c-reference"], tiny_project.root)
    assert whole.returncode == 0, whole.output[-5000:]
    run_dir = tiny_project.root / "runs" / "ctrl-c"
    # The session's XLA_FLAGS (8 devices, and its compile level) as the reference and the rerun get them: the
    # interrupted steps must compute the same bits as theirs.
    env = dict(os.environ, COLUMNS="200", TERM="xterm")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    master, terminal = pty.openpty()  # the live bar, as the user who presses Ctrl-C sees it
    process = subprocess.Popen(
        [*lm_train_command, "run", str(config), "--trainer.run_dir", str(run_dir)],
        cwd=tiny_project.root,
        env=env,
        stdout=terminal,
        stderr=terminal,
    )
    os.close(terminal)
    output = TerminalOutput(master)
    try:
        deadline = time.monotonic() + 300
        while output.steps_done(30) < 3 and process.poll() is None:
            assert time.monotonic() < deadline, "the bar showed no step 3 within 300 s:\n" + output.text[-3000:]
            output.read(0.02)
        done = output.steps_done(30)
        process.send_signal(signal.SIGINT)
        while process.poll() is None and time.monotonic() < deadline + 120:
            output.read(0.05)
        output.read(0.05)
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
    assert process.returncode == 128 + signal.SIGINT, output.text[-3000:]
    stopped_at = int(dist_ckpt.latest(run_dir / "checkpoints").name.split("-")[1])
    # The step in flight (done + 1) and the one queued behind it, plus one for a bar a refresh behind. Before, the
    # host had dispatched steps ahead of the device, up to the next log step, and ran them all first (done + 4 here).
    assert 3 <= done < stopped_at <= done + 3, (done, stopped_at)
    assert f"stopped by a signal at step {stopped_at}" in output.text
    rerun = cli(["run", str(config), "--trainer.run_dir", str(run_dir)], tiny_project.root)
    assert rerun.returncode == 0, rerun.output[-5000:]
    assert f"resuming from {run_dir / 'checkpoints' / f'step-{stopped_at}'}" in rerun.output
    reference = tiny_project.root / "runs" / "ctrl-c-reference"
    assert_bitwise_equal(reference / "checkpoints/step-30", run_dir / "checkpoints/step-30")
    loss = [r["train/loss"] for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert loss == [r["train/loss"] for r in trackers.read_jsonl(reference / "metrics.jsonl") if "train/loss" in r]


def test_kill_9_mid_run_then_rerun_is_bitwise_equal(tiny_project, reference_run, cli, lm_train_command):
    run_dir = tiny_project.root / "runs" / "killed"
    process = start_slow_run(tiny_project, run_dir, lm_train_command)
    try:
        wait_for_checkpoint(process, run_dir / "checkpoints", "step-4")
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL
    assert dist_ckpt.latest(run_dir / "checkpoints").name in {"step-4", "step-6"}
    rerun = cli(["run", str(tiny_project.config), "--trainer.run_dir", str(run_dir)], tiny_project.root)
    assert rerun.returncode == 0, rerun.output[-5000:]
    assert_bitwise_equal(reference_run / "checkpoints/step-12", run_dir / "checkpoints/step-12")


class PlainBucket:
    """A bucket on a test server, written and listed with each store's plain client (boto3 for S3, the JSON API
    over urllib for GCS), not through the code under test."""

    def __init__(self, server) -> None:
        self.server, self.name = server, server.new_bucket("run")

    def url(self, path: str) -> str:
        return self.server.url(self.name, path)

    def upload(self, path: Path, key: str) -> None:
        if self.server.scheme == "s3":
            import boto3

            boto3.client("s3").upload_file(str(path), self.name, key)
            return
        import urllib.parse
        import urllib.request

        query = urllib.parse.urlencode({"uploadType": "media", "name": key})
        address = f"{self.server.endpoint}/upload/storage/v1/b/{self.name}/o?{query}"
        with urllib.request.urlopen(urllib.request.Request(address, data=path.read_bytes(), method="POST")) as r:
            r.read()

    def keys(self) -> set[str]:
        if self.server.scheme == "s3":
            import boto3

            pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=self.name)
            return {o["Key"] for page in pages for o in page["Contents"]}
        import urllib.parse
        import urllib.request

        keys, token = set(), ""
        while True:
            query = urllib.parse.urlencode({"pageToken": token} if token else {})
            with urllib.request.urlopen(f"{self.server.endpoint}/storage/v1/b/{self.name}/o?{query}") as r:
                page = json.load(r)
            keys |= {item["name"] for item in page.get("items", [])}
            token = page.get("nextPageToken", "")
            if not token:
                return keys


@pytest.mark.parametrize("store", ["s3_server", "gcs_server"])
def test_a_run_kept_in_a_bucket_killed_and_rerun_equals_the_run_on_local_disk(
    request, store, tiny_project, reference_run, cli, lm_train_command
):
    """Corpus, tokenizer, cache, checkpoints and the HF export all at s3:// or gs:// (the local S3 server, the GCS
    emulator); only the run directory (config.yaml, metrics.jsonl) stays local. SIGKILL mid-run, rerun: the same
    bits as on local disk."""
    server = request.getfixturevalue(store)
    bucket = PlainBucket(server)
    for name in ("data/train_0.jsonl", "data/train_1.jsonl", "data/valid.jsonl", "tokenizer.json"):
        bucket.upload(tiny_project.root / name, f"inputs/{name}")
    url = bucket.url
    text = tiny_project.config.read_text(encoding="utf-8")
    for local, remote in (
        ('["data/train_{0..1}.jsonl"]', f'["{url("inputs/data/train_{0..1}.jsonl")}"]'),
        ('["data/valid.jsonl"]', f'["{url("inputs/data/valid.jsonl")}"]'),
        ("tokenizer: tokenizer.json", f"tokenizer: {url('inputs/tokenizer.json')}"),
        ("cache_dir: cache", f"cache_dir: {url('cache')}"),
        ("  checkpointer:\n", f"  checkpointer:\n    base_path: {url('checkpoints')}\n"),
    ):
        assert local in text
        text = text.replace(local, remote)
    config = tiny_project.write_config(f"in_a_{server.scheme}_bucket.yaml", text + f"hf_save_path: {url('hf')}\n")
    run_dir = tiny_project.root / "runs" / f"in_a_{server.scheme}_bucket"
    process = start_slow_run(tiny_project, run_dir, lm_train_command, config)
    try:
        wait_for_checkpoint(process, url("checkpoints"), "step-4")
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    rerun = cli(["run", str(config), "--trainer.run_dir", str(run_dir)], tiny_project.root)
    assert rerun.returncode == 0, rerun.output[-5000:]
    assert f"resuming from {server.scheme}://" in rerun.output
    assert_bitwise_equal(reference_run / "checkpoints/step-12", url("checkpoints/step-12"))
    # The checkpoints carry their run's config and tokenizer, so they alone serve export-hf (and eval, sample).
    exported = cli(["export-hf", url("checkpoints/step-12"), url("exported")], tiny_project.root)
    assert exported.returncode == 0, exported.output[-5000:]
    keys = bucket.keys()
    assert {"checkpoints/config.yaml", "checkpoints/tokenizer.json"} <= keys
    for export in ("hf/step-12", "exported"):
        assert {f"{export}/config.json", f"{export}/tokenizer.json", f"{export}/model.safetensors"} <= keys
    assert any(k.startswith("cache/") and k.endswith(".parquet") for k in keys)
    assert not (run_dir / "checkpoints").exists()


def test_eval_reports_the_validation_loss(tiny_project, reference_run, cli):
    result = cli(["eval", str(tiny_project.config), "--trainer.run_dir", "runs/reference"], tiny_project.root)
    assert result.returncode == 0, result.output[-5000:]
    rows = trackers.read_jsonl(reference_run / "metrics.jsonl")
    logged = [r["eval/loss"] for r in rows if "eval/loss" in r][-1]
    line = next(line for line in result.stdout.splitlines() if line.startswith("eval/loss"))
    assert float(line.split()[1]) == pytest.approx(logged, abs=1e-3)


def test_sample_continues_the_prompt(tiny_project, reference_run, cli, lm_train_command):
    checkpoint = reference_run / "checkpoints" / "step-12"
    args = ["sample", str(checkpoint), "--prompt", "import json", "--temperature", "0"]
    first = cli([*args, "--max-new-tokens", "8"], tiny_project.root)
    assert first.returncode == 0, first.output[-5000:]
    assert first.stdout.startswith("import json")
    again = cli([*args, "--max-new-tokens", "8"], tiny_project.root)
    assert again.stdout == first.stdout  # greedy decoding is deterministic
    # `lm-train serve` of the same checkpoint continues the same prompt greedily with the same tokens: its paged
    # engine against sample's contiguous cache, both as users run them (the serve tests' own server start).
    from test_serve import KEY, _start_server
    from tokenizers import Tokenizer

    flags = ["--max-pages", "16", "--page-size", "8", "--max-seqs", "1", "--prefill-chunk", "16"]
    process, url, log = _start_server(lm_train_command, checkpoint, tiny_project.root / "serve.log", flags)
    try:
        body = {"model": checkpoint.name, "prompt": "import json", "max_tokens": 8, "temperature": 0, "logprobs": 0,
                "ignore_eos": True, "return_tokens_as_token_ids": True}  # fmt: skip
        answer = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        assert answer.status_code == 200, answer.text
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        log.close()
    choice = answer.json()["choices"][0]
    served = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    tokenizer = Tokenizer.from_file(str(reference_run / "tokenizer.json"))
    prompt = tokenizer.encode("import json", add_special_tokens=False).ids
    assert len(served) == 8 and choice["finish_reason"] == "length"
    # sample prints the decoded prompt and tokens; the served ids decode to exactly that text.
    assert tokenizer.decode(prompt + served) == first.stdout.rstrip("\n")
    assert "import json" + choice["text"] == first.stdout.rstrip("\n")


def test_help_lists_every_command_and_config_key(lm_train_command):
    top = subprocess.run([*lm_train_command, "--help"], capture_output=True, text=True, timeout=120)
    for command in ("run", "eval", "export-hf", "sample", "cache", "config"):
        assert command in top.stdout
    run_help = subprocess.run([*lm_train_command, "run", "--help"], capture_output=True, text=True, timeout=120)
    assert "--trainer.num_train_steps (int, default 1000)" in " ".join(run_help.stdout.split())


def test_run_exports_hf_at_the_end(reference_run):
    exported = reference_run / "hf" / "step-12"
    assert (exported / "config.json").exists() and (exported / "tokenizer.json").exists()


def test_export_hf_loads_in_transformers_with_matching_logits(tiny_project, reference_run, cli, tmp_path):
    torch = pytest.importorskip("torch") if os.environ.get("CI") != "true" else __import__("torch")
    import jax.numpy as jnp
    import transformers

    import named_tensors as nt
    from lm_train.run.checkpoints import load_model

    out = tmp_path / "hf"
    result = cli(["export-hf", str(reference_run / "checkpoints" / "step-12"), str(out)], tiny_project.root)
    assert result.returncode == 0, result.output[-5000:]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer("import json\nfrom email import message\n")["input_ids"][:16]
    ours = load_model(reference_run / "checkpoints" / "step-12")
    our_logits = ours.model(nt.named(jnp.asarray([ids], jnp.int32), ("batch", "position")))
    with torch.no_grad():
        their_logits = theirs(torch.tensor([ids])).logits.numpy()
    ours_np = np.asarray(nt.permute(our_logits, ("batch", "position", "vocab")).array)
    assert np.abs(ours_np - their_logits).max() < 1e-4
    again = cli(["export-hf", str(reference_run / "checkpoints" / "step-12"), str(out)], tiny_project.root)
    assert again.returncode == 2 and "overwrite" in again.stderr


def test_initialize_from_hf_starts_from_the_exported_weights(tiny_project, reference_run, cli):
    exported = reference_run / "hf" / "step-12"
    args = ["run", str(tiny_project.config), "--trainer.run_dir", "runs/from_hf", "--trainer.num_train_steps", "2"]
    # The same run also watches the gradients from inside the compiled step, logged to jsonl and TensorBoard.
    watch = ["--trainer.watch.watch_targets", "[grads]", "--trainer.watch.interval", "1"]
    watch += ["--trainer.tracker", "{type: tensorboard}"]
    result = cli(
        [*args, "--trainer.steps_per_eval", "2", "--initialize_from_hf", str(exported), *watch], tiny_project.root
    )
    assert result.returncode == 0, result.output[-5000:]
    assert f"initialized the model from {exported}" in result.output
    check_watched_gradients(tiny_project.root / "runs" / "from_hf")
    reference_evals = [r["eval/loss"] for r in trackers.read_jsonl(reference_run / "metrics.jsonl") if "eval/loss" in r]
    rows = trackers.read_jsonl(tiny_project.root / "runs" / "from_hf" / "metrics.jsonl")
    from_hf = next(r["eval/loss"] for r in rows if "eval/loss" in r)
    # Two more steps from the exported weights score about as well as the run that produced them, and better
    # than that run did halfway (a fresh initialisation would be far worse).
    assert from_hf < reference_evals[0]
    assert abs(from_hf - reference_evals[-1]) < 0.5


def check_watched_gradients(run_dir: Path) -> None:
    """Per-layer gradient norms reached metrics.jsonl and TensorBoard, and they make up optim/grad_norm."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    by_step: dict[int, dict] = {}
    for row in trackers.read_jsonl(run_dir / "metrics.jsonl"):
        by_step.setdefault(row["step"], {}).update(row)
    assert sorted(s for s, r in by_step.items() if "grads/norm/total" in r) == [1, 2]
    last = by_step[2]
    layers = sorted(k for k in last if k.startswith("grads/norm/blocks/") and "/layer_" in k)
    assert layers and any(k.endswith("/layer_0") for k in layers) and any(k.endswith("/layer_1") for k in layers)
    leaves = [v for k, v in last.items() if k.startswith("grads/norm/") and k != "grads/norm/total"]
    assert np.sqrt(np.sum(np.square(leaves))) == pytest.approx(last["grads/norm/total"], rel=1e-5)
    assert last["grads/norm/total"] == pytest.approx(last["optim/grad_norm"], rel=1e-5)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert set(layers) <= set(events.Tags()["scalars"])
    logged = {e.step: e.value for e in events.Scalars("grads/norm/total")}
    assert logged[2] == pytest.approx(last["grads/norm/total"], rel=1e-6)


def test_a_run_shorter_than_its_cache_build_stops_the_build_and_the_next_run_resumes_it(cli, tmp_path):
    """The default config, cold, for one step: the build of the standard library is still running at the end."""
    config = str(Path(__file__).parents[1] / "configs" / "gpt2_nano.yaml")
    # Built by Ray (the standard library's 12 MB would otherwise be tokenized in-process): the Ray build is the
    # one whose tasks and local Ray must end with the run.
    short = ["--trainer.num_train_steps", "1", "--trainer.run_dir", "run", "--data.cache_dir", "cache"]
    short += ["--data.cache_build", "ray"]
    result = cli(["run", config, *short], tmp_path)
    assert result.returncode == 0, result.output[-5000:]
    # One Ray for the whole run: no build thread outlives it and starts another while the process exits.
    assert result.output.count("Started a local Ray instance") == 1, result.output[-5000:]
    assert "SIGTERM handler is not set" not in result.output
    assert "os.fork() was called" not in result.output
    (train_cache,) = (tmp_path / "cache").glob("tok-*/train")
    ledger = json.loads((train_cache / "ledger.json").read_text())
    assert not ledger.get("error") and not (train_cache / ".locks").exists() and not (train_cache / ".lock").exists()
    # Whether or not that build got to its end, the cache command finishes it from where it stands.
    built = cli(["cache", config, "--data.cache_dir", "cache"], tmp_path)  # in-process (auto) resumes a Ray build
    assert built.returncode == 0, built.output[-5000:]
    assert json.loads((train_cache / "ledger.json").read_text())["finished"]
