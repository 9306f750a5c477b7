"""The CLI exits 0 after success every time: no library thread left running while Python finalises (issue: 2
of 31 `verify` runs aborted with `terminate called without an active exception`, exit 134).

The cause: `pq.read_table` scans through pyarrow.dataset, whose thread pool could still hold the last reference
to the chunk's Python buffer when the interpreter finalised; that thread then died in a C++ destructor. How
often depends on timing, so besides the 50 runs, a check that fails every time on that path: reading and
verifying never load pyarrow.dataset.
"""

import os
import subprocess
import sys

from shard_cache import build_cache

RUNS = 50


def _cli_env(tmp_path):
    """The environment for CLI runs: byte-compiled modules cached (the first run writes them), so that each of
    the many short processes costs its imports only once."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "pycache")
    return env


def _run_all(commands, env):
    """Start every command, then wait for each; returns (command, returncode, stderr tail) of the failures."""
    failures = []
    for batch in (commands[i : i + 2] for i in range(0, len(commands), 2)):  # two at a time: two cores
        procs = [
            (cmd, subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            for cmd in batch
        ]
        for cmd, proc in procs:
            _, err = proc.communicate(timeout=120)
            if proc.returncode != 0:
                failures.append((cmd[3:5], proc.returncode, err[-300:]))
    return failures


def test_verify_inspect_and_build_exit_0_every_time(tmp_path, tokenizer_path, tools, ray_cluster):
    for s in range(2):
        tools.write_jsonl(tmp_path / f"in-{s}.jsonl", tools.make_docs(6, seed=50 + s))
    inputs = str(tmp_path / "in-{0..1}.jsonl")
    cache = str(tmp_path / "cache")
    build_cache([inputs], cache, tokenizer=str(tokenizer_path), chunk_size=3, progress=False)
    env = _cli_env(tmp_path)
    cli = [sys.executable, "-m", "shard_cache.cli"]
    commands = []
    for _ in range(RUNS):
        commands += [[*cli, "verify", cache, "--no-progress"], [*cli, "inspect", cache]]
    build = [*cli, "build", inputs, "--tokenizer", str(tokenizer_path), "--chunk-size", "3", "--no-progress"]
    # builds that run Ray tasks (joining the session's cluster), and builds that find the cache finished
    commands += [[*build, "--out", str(tmp_path / f"new-{i}"), "--ray-address", ray_cluster] for i in range(2)]
    commands += [[*build, "--out", cache] for _ in range(6)]
    failures = _run_all(commands, env)
    assert not failures, f"{len(failures)} of {len(commands)} runs failed: {failures[:3]}"
    probe = (
        "import sys\n"
        "from shard_cache import open_cache\n"
        "from shard_cache.cli import main\n"
        f"assert main(['verify', {cache!r}, '--no-progress']) == 0\n"
        f"windows = open_cache({cache!r}).token_windows(4)\n"
        "windows.get_batch(list(range(windows.final_num_examples())))\n"
        "print('pyarrow.dataset' in sys.modules, 'pyarrow.parquet' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["False", "True"], done.stderr[-2000:]
