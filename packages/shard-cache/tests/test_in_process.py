"""The in-process build writes the bytes a Ray build writes, stops between chunks, and resumes to the same bytes."""

import json
import subprocess
import sys
import threading

import pyarrow.parquet as pq

from shard_cache import TokenizerProcessor, build_cache
from shard_cache.executors import IN_PROCESS_MAX_BYTES, choose_in_process


def _corpus(tmp_path, tools):
    """Three shards of several chunks each; one record of the second shard is malformed (skipped)."""
    for s in range(3):
        lines = [json.dumps({"text": d}) for d in tools.make_docs(11 + 3 * s, seed=40 + s)]
        if s == 1:
            lines[4] = '{"text": "unterminated'
        (tmp_path / f"part-{s}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return [str(tmp_path / "part-{0..2}.jsonl")]


class _StopAfter(TokenizerProcessor):
    """Sets `stop` once it has tokenized `chunks` chunks, as a caller's stop request would mid-build."""

    def __init__(self, tokenizer, stop: threading.Event, chunks: int):
        super().__init__(tokenizer)
        self.stop, self.left = stop, chunks

    def __call__(self, docs):
        self.left -= 1
        if self.left == 0:
            self.stop.set()
        return super().__call__(docs)


def test_in_process_and_ray_builds_write_the_same_bytes_and_a_stop_resumes_to_them(
    tmp_path, tokenizer_path, tools, ray_cluster
):
    inputs = _corpus(tmp_path, tools)
    options = dict(tokenizer=str(tokenizer_path), chunk_size=3, on_bad_input="skip", progress=False)
    local = build_cache(inputs, str(tmp_path / "local"), in_process=True, **options)
    on_ray = build_cache(inputs, str(tmp_path / "ray"), in_process=False, **options)
    assert local.finished and local.shards == 3 and local.chunks == 4 + 5 + 6 and local.skipped == on_ray.skipped
    assert sum(local.skipped.values()) == 1
    assert tools.tree_bytes(tmp_path / "local") == tools.tree_bytes(tmp_path / "ray")
    ledgers_of = ("local", "ray")
    ledgers = [json.loads((tmp_path / name / "ledger.json").read_text()) for name in ledgers_of]
    assert ledgers[0] == ledgers[1] and ledgers[0]["finished"]
    # read back with plain pyarrow: the same rows, chunk by chunk
    tables = {n: [pq.read_table(p).to_pylist() for p in sorted((tmp_path / n).rglob("*.parquet"))] for n in ledgers_of}
    assert len(tables["local"]) == 15 and tables["local"] == tables["ray"]

    stop = threading.Event()
    options.pop("tokenizer")
    stopping = _StopAfter(str(tokenizer_path), stop, chunks=5)
    stopped = build_cache(inputs, str(tmp_path / "stopped"), processor=stopping, in_process=True, stop=stop, **options)
    # the stop is seen right after the chunk that set it: nothing further is tokenized or committed
    assert not stopped.finished and stopped.chunks == 5 and stopping.left == 0
    assert not json.loads((tmp_path / "stopped" / "ledger.json").read_text())["finished"]
    resumed = build_cache(
        inputs, str(tmp_path / "stopped"), processor=TokenizerProcessor(str(tokenizer_path)), in_process=True, **options
    )
    assert resumed.finished and resumed.chunks == 15
    assert tools.tree_bytes(tmp_path / "stopped") == tools.tree_bytes(tmp_path / "local")


def test_auto_builds_small_known_inputs_in_process_and_never_imports_ray(tmp_path, tokenizer_path, tools):
    assert choose_in_process(None, None, [10, IN_PROCESS_MAX_BYTES - 10])
    assert not choose_in_process(None, None, [10, IN_PROCESS_MAX_BYTES])  # over the limit
    assert not choose_in_process(None, None, [10, None])  # a size unknown (an hf: dataset)
    assert not choose_in_process(None, "10.0.0.1:6379", [10])  # an address given asks for that cluster
    assert choose_in_process(True, "10.0.0.1:6379", [IN_PROCESS_MAX_BYTES * 2])
    assert not choose_in_process(False, None, [10])
    inputs = _corpus(tmp_path, tools)
    code = (
        "import sys, json; from shard_cache import build_cache; "
        f"r = build_cache({inputs!r}, {str(tmp_path / 'c')!r}, tokenizer={str(tokenizer_path)!r}, chunk_size=3, "
        "on_bad_input='skip', progress=False); print(json.dumps([r.finished, r.chunks, 'ray' in sys.modules]))"
    )
    # RAY_ADDRESS alone does not force Ray: a small build stays in this process even where one is set
    env = {"RAY_ADDRESS": "127.0.0.1:1", "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == [True, 15, False]
