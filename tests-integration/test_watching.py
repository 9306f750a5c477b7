"""Watching a run, end to end with the real `lm-train` command: one tiny run with the profiler, the eval
harness and wandb (offline) on; then `plot`, `viz` (read back in headless Chromium) and `harness` on it,
and the harness scores against lm-eval's own Hugging Face backend on the run's export."""

from __future__ import annotations

import functools
import gzip
import html.parser
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("matplotlib")

TASKS = ("stdlib_next_line_mc", "stdlib_line_completion", "stdlib_perplexity")
EXAMPLES = 6
IN_CI = os.environ.get("CI") == "true"


@pytest.fixture(scope="module")
def watched(tiny_project, cli, tmp_path_factory, offline_wandb_env):
    """A 12-step run with seq_len 64, profiling steps 3-4, the three built-in harness tasks at the end, wandb."""

    home = tmp_path_factory.mktemp("wandb-home")
    env = offline_wandb_env(home)
    args = ["run", str(tiny_project.config), "--trainer.run_dir", "runs/watched", "--model.seq_len", "64"]
    args += ["--trainer.profiler.start_step", "3", "--trainer.profiler.num_steps", "2"]
    args += ["--trainer.eval_harness.tasks", f"[{', '.join(TASKS)}]", "--trainer.eval_harness.every", "12"]
    args += ["--trainer.eval_harness.max_examples", str(EXAMPLES), "--trainer.tracker", "{type: wandb, mode: offline}"]
    result = cli(args, tiny_project.root, env=env)
    assert result.returncode == 0, result.output[-6000:]
    return tiny_project.root / "runs" / "watched", result


def test_profiler_traces_the_asked_steps_and_uploads_them(watched, wandb_reader):
    run_dir, result = watched
    [trace] = sorted((run_dir / "profile").glob("plugins/profile/*/perfetto_trace.json.gz"))
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]  # Perfetto's JSON trace format
    steps = sorted({int(e["args"]["step_num"]) for e in events if e.get("name") == "train_step"})
    assert steps == [3, 4]
    assert any("train_step" in str(e.get("name")) or "jit" in str(e.get("name")).lower() for e in events)
    assert f"profile of steps 3-4 written to {trace.relative_to(run_dir.parent.parent)}" in result.output
    assert "https://ui.perfetto.dev" in result.output and "tensorboard --logdir" in result.output
    [run_file] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run = wandb_reader(run_file)
    assert [(a.name, a.type) for a in run["artifacts"]] == [("profile-steps-3-4", "jax_profile")]
    logged = {k for row in run["history"] for k in row}
    assert {"harness/stdlib_next_line_mc/acc", "harness/stdlib_perplexity/word_perplexity"} <= logged


def harness_scores(metrics_file: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return {k: v for row in rows for k, v in row.items() if k.startswith("harness/") and row["step"] == 12}


def test_harness_cli_scores_like_training_and_like_lm_evals_hf_backend(watched, cli, tmp_path):
    run_dir, _ = watched
    during = harness_scores(run_dir / "metrics.jsonl")
    expected = {"acc", "acc_norm"}, {"exact_match"}, {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    for task, metrics in zip(TASKS, expected, strict=True):
        assert {k.rsplit("/", 1)[1] for k in during if k.split("/")[1] == task} == metrics
    out = tmp_path / "scores.json"
    args = ["harness", str(run_dir), *[a for t in TASKS for a in ("--tasks", t)], "--max-examples", str(EXAMPLES)]
    result = cli([*args, "--log-samples", "--out", str(out)], run_dir.parent.parent)
    assert result.returncode == 0, result.output[-6000:]
    ours = json.loads(out.read_text())
    assert ours["step"] == 12 and ours["metrics"].keys() == during.keys()
    for key, value in during.items():  # the checkpoint is the trained model: the same scores
        assert ours["metrics"][key] == pytest.approx(value, rel=1e-6), key
    assert f"harness/stdlib_next_line_mc/acc {during['harness/stdlib_next_line_mc/acc']:.4f}" in result.stdout

    torch = __import__("torch") if IN_CI else pytest.importorskip("torch")
    torch.set_num_threads(1)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    hf = HFLM(pretrained=str(run_dir / "hf" / "step-12"), device="cpu", dtype="float32", batch_size=1)
    manager = TaskManager(include_path=str(run_dir / "harness" / "tasks"), include_defaults=False)
    theirs = simple_evaluate(model=hf, tasks=list(TASKS), task_manager=manager, limit=EXAMPLES, bootstrap_iters=0)
    for task in TASKS:
        mine = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
        reference = sorted(theirs["samples"][task], key=lambda s: s["doc_id"])
        assert len(mine) == len(reference) == EXAMPLES
        for a, b in zip(mine, reference, strict=True):
            if task == "stdlib_line_completion":
                assert a["resps"] == b["resps"], a["doc"]  # the same greedy continuations
                continue
            ll_a = np.array([r[0][0] if isinstance(r[0], list) else r[0] for r in a["resps"]], np.float64)
            ll_b = np.array([r[0][0] if isinstance(r[0], tuple | list) else r[0] for r in b["resps"]], np.float64)
            # 1e-4 per score, and for a whole document's rolling sum (thousands of nats) 1e-7 of it: float32
            # sums in another order (XLA against torch) differ by a few ulps, about 1e-7 of their size.
            np.testing.assert_allclose(ll_a, ll_b, rtol=1e-7, atol=1e-4, err_msg=f"{task} doc {a['doc_id']}")
        for name, value in theirs["results"][task].items():
            metric = name.split(",")[0]
            if "_stderr" not in metric and isinstance(value, float):
                assert ours["metrics"][f"harness/{task}/{metric}"] == pytest.approx(value, rel=1e-4), (task, name)


def test_plot_of_the_real_run(watched, cli, tmp_path):
    run_dir, _ = watched
    out = tmp_path / "plot.png"
    result = cli(["plot", str(run_dir), "--out", str(out), "--x", "tokens"], run_dir.parent.parent)
    assert result.returncode == 0, result.output[-4000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class TokenSpans(html.parser.HTMLParser):
    """Every `<span class="tok">` of a page: its text and data-lp, grouped by document section."""

    def __init__(self):
        super().__init__()
        self.documents: list[list[tuple[str, float]]] = []
        self._open: dict | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.documents.append([])
        if tag == "span" and "tok" in attrs.get("class", "").split():
            self._open = {"lp": float(attrs["data-lp"]), "text": ""}

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data

    def handle_endtag(self, tag):
        if tag == "span" and self._open is not None:
            self.documents[-1].append((self._open["text"], self._open["lp"]))
            self._open = None


def chromium(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium")
    if binary is None:
        if IN_CI:
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [binary, *flags, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120
        )


@functools.cache
def reference_logits(checkpoint: Path):
    """A jitted function ids -> logits (position, vocab) of a checkpoint's model, loaded once."""
    import jax
    import jax.numpy as jnp

    import named_tensors as nt
    from lm_train.run.checkpoints import load_model

    model = load_model(checkpoint).model

    @jax.jit
    def logits(ids):
        out = model(nt.named(ids[None], ("batch", "position")))
        return nt.permute(out, ("batch", "position", "vocab")).array[0].astype(jnp.float32)

    return lambda ids: logits(jnp.asarray(ids, jnp.int32))


def reference_log_probs(checkpoint: Path, ids: list[int], seq_len: int) -> np.ndarray:
    """log p(ids[i] | ids[<i]) for i >= 1 in windows of seq_len overlapping by one, with plain jax.numpy."""
    import jax

    out, start = [], 0
    while True:
        window = ids[start : start + seq_len]
        log_probs = np.asarray(jax.nn.log_softmax(reference_logits(checkpoint)(window), axis=-1))
        out.extend(float(log_probs[t, window[t + 1]]) for t in range(len(window) - 1))
        if start + seq_len >= len(ids):
            return np.array(out)
        start += seq_len - 1


def test_viz_page_shows_each_token_with_its_log_prob(watched, cli, tmp_path):
    import shard_cache

    run_dir, _ = watched
    root = run_dir.parent.parent
    page, diff = tmp_path / "page.html", tmp_path / "diff.html"
    args = ["viz", str(run_dir / "checkpoints" / "step-12"), "--data", "data/valid.jsonl", "--max-docs", "2"]
    result = cli([*args, "--max-tokens", "150", "--out", str(page)], root)
    assert result.returncode == 0, result.output[-4000:]
    early = str(run_dir / "checkpoints" / "step-6")
    result = cli([*args, "--max-tokens", "40", "--out", str(diff), "--compare", early], root)
    assert result.returncode == 0, result.output[-4000:]
    text = page.read_text()
    assert "<script src" not in text and "<link" not in text and "http" not in text.split("<body>")[1]

    shot = tmp_path / "page.png"
    done = chromium(f"--screenshot={shot}", "--window-size=1200,900", page.as_uri())
    assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", done.stderr[-2000:]
    dom = chromium("--dump-dom", page.as_uri())
    parsed = TokenSpans()
    parsed.feed(dom.stdout)
    assert len(parsed.documents) == 2

    tokenizer = shard_cache.load_tokenizer(str(run_dir / "tokenizer.json"))
    eos = shard_cache.TokenizerProcessor(tokenizer).eos_id
    documents = [json.loads(line)["text"] for line in (root / "data" / "valid.jsonl").read_text().splitlines()]
    checkpoint = run_dir / "checkpoints" / "step-12"
    for text_of_doc, spans in zip(documents, parsed.documents, strict=False):
        ids = tokenizer.encode(text_of_doc, add_special_tokens=False).ids[:150]
        assert len(spans) == len(ids)
        assert "".join(t for t, _ in spans) == text_of_doc[: len("".join(t for t, _ in spans))]
        expected = reference_log_probs(checkpoint, [eos, *ids], 64)
        assert np.abs(np.array([lp for _, lp in spans]) - expected).max() < 1e-4

    compared = TokenSpans()
    compared.feed(chromium("--dump-dom", diff.as_uri()).stdout)
    ids = tokenizer.encode(documents[0], add_special_tokens=False).ids[:40]
    later = reference_log_probs(checkpoint, [eos, *ids], 64)
    earlier = reference_log_probs(run_dir / "checkpoints" / "step-6", [eos, *ids], 64)
    assert np.abs(np.array([lp for _, lp in compared.documents[0]]) - (later - earlier)).max() < 1e-4
