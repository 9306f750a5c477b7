import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shard_cache import build_cache, verify_cache

BUILD_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from shard_cache import TokenizerProcessor, build_cache

    class SlowTokenizerProcessor(TokenizerProcessor):
        def __call__(self, docs):
            time.sleep(0.08)  # slow enough to be killed mid-way; the output is unchanged
            return super().__call__(docs)

    inputs, out, tokenizer, address = sys.argv[1:5]
    build_cache([inputs], out, processor=SlowTokenizerProcessor(tokenizer), chunk_size=2, ray_address=address,
                progress=False)
    """
)


def committed_chunks(out) -> int:
    try:
        ledger = json.loads((out / "ledger.json").read_text())
    except (FileNotFoundError, ValueError):
        return 0
    return sum(len(s["chunks"]) for s in ledger["shards"])


@pytest.fixture(scope="module")
def corpus_and_reference(tmp_path_factory, tokenizer_path, tools):
    root = tmp_path_factory.mktemp("resume")
    for s, n in enumerate((50, 36, 44)):
        tools.write_jsonl(root / f"in-{s}.jsonl", tools.make_docs(n, seed=20 + s))
    (root / "in-3.jsonl").write_text("")  # an empty shard is done at once
    reference = root / "reference"
    build_cache(
        [str(root / "in-{0..3}.jsonl")], str(reference), tokenizer=str(tokenizer_path), chunk_size=2, progress=False
    )
    return root, tools.tree_bytes(reference)


@pytest.mark.parametrize("kill_after_chunks", [0, 24])
def test_kill_9_then_resume_gives_the_bytes_of_an_uninterrupted_build(
    corpus_and_reference, tmp_path, tokenizer_path, tools, ray_cluster, kill_after_chunks
):
    root, reference = corpus_and_reference
    out = tmp_path / "cache"
    script = tmp_path / "build.py"
    script.write_text(BUILD_SCRIPT)
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    args = [sys.executable, str(script), str(root / "in-{0..3}.jsonl"), str(out), str(tokenizer_path), ray_cluster]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        if list(out.glob(".locks/*.json")) and committed_chunks(out) >= kill_after_chunks:
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"the build ended before it could be killed: {proc.stdout.read().decode()}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ledger = json.loads((out / "ledger.json").read_text()) if (out / "ledger.json").exists() else None
    assert ledger is None or not ledger["finished"], "killed mid-way"
    assert list(out.glob(".locks/*.json"))  # a dead builder's lock stays behind and is taken over
    time.sleep(0.5)  # let Ray reap the dead driver's workers
    result = build_cache(
        [str(root / "in-{0..3}.jsonl")], str(out), tokenizer=str(tokenizer_path), chunk_size=2, progress=False
    )
    assert result.docs == 130
    assert tools.tree_bytes(out) == reference
    assert verify_cache(str(out)).ok
