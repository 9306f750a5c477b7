"""Large host buffers on transparent huge pages: glibc's malloc is told to ask for them.

XLA:CPU allocates a step's temporaries afresh on every call. glibc serves an allocation that large with a new
mmap, and the kernel then faults in and zeroes every 4 KiB page on first touch: for GPT-2 at width 256 on a CPU,
~156,000 faults (610 MB) a step, nearly a fifth of its time. With glibc's `glibc.malloc.hugetlb=1` tunable those
mappings are advised to use 2 MiB pages: ~600 faults a step. A tunable is read only when a process starts, so
`lm-train` starts itself again, once, with it set (the same process id, arguments and interpreter).

`LM_TRAIN_HUGEPAGES=0` turns this off; a `glibc.malloc.hugetlb` the user has set is left as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "LM_TRAIN_HUGEPAGES"
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
_FIRST_GLIBC_WITH_TUNABLE = (2, 35)
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def glibc_version() -> tuple[int, int] | None:
    """The C library's version when it is glibc (None on musl, macOS, Windows)."""
    try:
        value = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
    except (AttributeError, ValueError, OSError):
        return None
    if value is None:
        return None
    name, _, version = value.partition(" ")
    if name != "glibc":
        return None
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def transparent_hugepage_mode(path: str = _THP_MODE_FILE) -> str | None:
    """The kernel's THP mode, the bracketed word of `always [madvise] never`; None when there is no such file."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def hugepage_malloc_env(
    environ: Mapping[str, str], glibc: tuple[int, int] | None, thp_mode: str | None
) -> dict[str, str] | None:
    """The environment to start again with, or None when there is nothing to gain or the user decided.

    Nothing to gain: not glibc, a glibc older than the tunable (2.35), a kernel without THP (`never`), or another
    allocator preloaded (jemalloc, tcmalloc, mimalloc).
    """
    if environ.get(OPT_OUT, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    if glibc is None or glibc < _FIRST_GLIBC_WITH_TUNABLE or thp_mode not in ("always", "madvise"):
        return None
    if any(name in environ.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS):
        return None  # glibc's malloc is not the one in use
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(item.partition("=")[0] == TUNABLE for item in tunables.split(":")):
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"
    return env


def hugepage_malloc_active(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process started with malloc on transparent huge pages."""
    environ = os.environ if environ is None else environ
    items = environ.get("GLIBC_TUNABLES", "").split(":")
    return f"{TUNABLE}=1" in items and transparent_hugepage_mode() in ("always", "madvise")


def restart_with_hugepage_malloc() -> None:
    """Replace this process by the same command with the tunable set, when that gains anything; else return.

    Call it first thing in a program's entry point, before anything is imported or started that a second start
    would repeat.
    """
    if sys.platform != "linux" or not sys.executable or not getattr(sys, "orig_argv", None):
        return
    env = hugepage_malloc_env(os.environ, glibc_version(), transparent_hugepage_mode())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # an interpreter that cannot be started again runs on as it is, with 4 KiB pages


__all__ = [
    "OPT_OUT",
    "TUNABLE",
    "glibc_version",
    "hugepage_malloc_active",
    "hugepage_malloc_env",
    "restart_with_hugepage_malloc",
    "transparent_hugepage_mode",
]
