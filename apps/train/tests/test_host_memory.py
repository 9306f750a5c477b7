"""lm-train starts itself again with glibc's malloc on transparent huge pages, where that helps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from lm_train.run.host_memory import (
    OPT_OUT,
    TUNABLE,
    glibc_version,
    hugepage_malloc_active,
    hugepage_malloc_env,
    transparent_hugepage_mode,
)

NEW = (2, 36)


@pytest.mark.parametrize(
    ("environ", "glibc", "thp", "tunables"),
    [
        ({}, NEW, "madvise", f"{TUNABLE}=1"),
        ({}, NEW, "always", f"{TUNABLE}=1"),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, NEW, "madvise", f"glibc.malloc.arena_max=2:{TUNABLE}=1"),
        ({"GLIBC_TUNABLES": f"{TUNABLE}=0"}, NEW, "madvise", None),  # the user's own choice stands
        ({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}=2"}, NEW, "madvise", None),
        ({OPT_OUT: "0"}, NEW, "madvise", None),
        ({OPT_OUT: "off"}, NEW, "madvise", None),
        ({OPT_OUT: "1"}, NEW, "madvise", f"{TUNABLE}=1"),
        ({}, (2, 34), "madvise", None),  # the tunable came in glibc 2.35; older ones ignore it
        ({}, None, "madvise", None),  # musl, macOS
        ({}, NEW, "never", None),
        ({}, NEW, None, None),  # no THP in the kernel
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, NEW, "madvise", None),
        ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, NEW, "madvise", None),
    ],
)
def test_when_to_start_again_and_with_what(environ, glibc, thp, tunables):
    env = hugepage_malloc_env({"PATH": "/bin", **environ}, glibc, thp)
    if tunables is None:
        assert env is None
    else:
        assert env is not None and env["GLIBC_TUNABLES"] == tunables and env["PATH"] == "/bin"
        assert hugepage_malloc_env(env, glibc, thp) is None  # once started again, it does not loop


def test_reads_the_kernels_thp_mode(tmp_path: Path):
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert transparent_hugepage_mode(str(mode)) == "madvise"
    mode.write_text("[always] madvise never\n")
    assert transparent_hugepage_mode(str(mode)) == "always"
    mode.write_text("garbled\n")
    assert transparent_hugepage_mode(str(mode)) is None
    assert transparent_hugepage_mode(str(tmp_path / "absent")) is None


_TOUCH = """
import ctypes, json, os, resource, sys
before = os.getpid()
print(json.dumps({"started": before, "tunables": os.environ.get("GLIBC_TUNABLES")}), flush=True)
from lm_train.run.host_memory import restart_with_hugepage_malloc
restart_with_hugepage_malloc()
faults = []
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
for _ in range(2):  # as XLA:CPU does with a step's temporaries: malloc afresh, write, free (numpy has its own way)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = libc.malloc(256 * 2**20)
    ctypes.memset(buffer, 1, 256 * 2**20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
    libc.free(buffer)
print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "faults": faults}), flush=True)
"""
_PAGES = 256 * 2**20 // 4096


def _touch(**env: str) -> list[dict]:
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    out = subprocess.run(
        [sys.executable, "-c", _TOUCH, "an-argument"],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.skipif(
    glibc_version() is None or glibc_version() < (2, 35) or transparent_hugepage_mode() not in ("always", "madvise"),
    reason="needs glibc >= 2.35 and a kernel with transparent huge pages",
)
def test_started_again_a_fresh_buffer_faults_in_huge_pages():
    lines = _touch()
    assert len(lines) == 3, f"expected the program to start twice: {lines}"
    first, started, ran = lines
    assert first["tunables"] is None and started["tunables"] == f"{TUNABLE}=1"
    assert first["started"] == started["started"] == ran["pid"]  # the same process, started again
    assert ran["argv"] == ["an-argument"]
    # 256 MiB is 65,536 pages of 4 KiB, and 128 of 2 MiB.
    assert max(ran["faults"]) < _PAGES // 8, ran["faults"]

    opted_out = _touch(**{OPT_OUT: "0"})
    assert len(opted_out) == 2 and opted_out[0]["tunables"] is None
    if transparent_hugepage_mode() == "madvise":  # with "always" the kernel may use huge pages anyway
        assert min(opted_out[1]["faults"]) > _PAGES * 0.9, opted_out[1]["faults"]


def test_the_command_starts_again_before_the_cli(tmp_path: Path):
    """`lm-train` and `python -m lm_train` go through the restart; `main` is the console script's target."""
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "lm-train"]
    assert script.value == "lm_train.__main__:main"
    code = (
        "import os, sys, runpy\n"
        "print('tunables', os.environ.get('GLIBC_TUNABLES'), flush=True)\n"
        "sys.argv = ['lm-train', '--help']\n"
        "runpy.run_module('lm_train', run_name='__main__')\n"
    )
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("tunables")]
    expected = hugepage_malloc_env(environ, glibc_version(), transparent_hugepage_mode())
    if expected is None:
        assert lines == ["tunables None"]
    else:
        assert lines == ["tunables None", f"tunables {expected['GLIBC_TUNABLES']}"]
    assert out.stdout.count("Usage: lm-train") == 1


def test_active_reads_the_environment():
    assert not hugepage_malloc_active({"GLIBC_TUNABLES": f"{TUNABLE}=0"})
    assert hugepage_malloc_active({"GLIBC_TUNABLES": f"x=1:{TUNABLE}=1"}) == (
        transparent_hugepage_mode() in ("always", "madvise")
    )


_STEP = """
import hashlib, json, os
from lm_train.run.host_memory import hugepage_malloc_active, restart_with_hugepage_malloc
restart_with_hugepage_malloc()
import jax, jax.numpy as jnp

def loss(w, x):  # temporaries of tens of MiB a call, as a small train step has
    h = jnp.tanh(x @ w[0])
    return jnp.mean(jax.nn.logsumexp(h @ w[1], axis=-1))

keys = jax.random.split(jax.random.key(0), 3)
w = (jax.random.normal(keys[0], (512, 2048)) / 23, jax.random.normal(keys[1], (2048, 4096)) / 45)
x = jax.random.normal(keys[2], (2048, 512))
step = jax.jit(jax.value_and_grad(loss))
for _ in range(3):
    value, grads = step(w, x)
    w = jax.tree.map(lambda p, g: p - 0.1 * g, w, grads)
digest = hashlib.sha256(b"".join(jax.device_get(a).tobytes() for a in (value, *w))).hexdigest()
print(json.dumps({"huge_pages": hugepage_malloc_active(), "digest": digest}))
"""


def test_the_bits_are_the_same_on_huge_pages():
    """Only where the memory comes from changes: three steps of a jitted gradient give the same bits."""
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    results = []
    for opt_out in ("0", "1"):
        out = subprocess.run(
            [sys.executable, "-c", _STEP],
            env={**environ, OPT_OUT: opt_out},
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        results.append(json.loads(out.stdout.splitlines()[-1]))
    off, on = results
    assert not off["huge_pages"]
    if hugepage_malloc_env(environ, glibc_version(), transparent_hugepage_mode()) is not None:
        assert on["huge_pages"]
    assert on["digest"] == off["digest"]
