"""`lm-train serve`: load the source, check the engine's settings, and serve it over HTTP until SIGTERM or Ctrl-C."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

from lm_train.errors import UserError

from .engine_config import EngineConfig

# The flag of each engine setting whose name differs from it.
FLAGS = {"num_pages": "max-pages", "max_waiting": "max-concurrent"}


# Seconds that SIGTERM lets the requests in flight finish before it cancels them (uvicorn's graceful shutdown).
GRACEFUL_STOP_S = 30


def check_serve_options(
    config: EngineConfig, host: str, port: int, graceful_stop: int = GRACEFUL_STOP_S
) -> EngineConfig:
    """The engine's settings, or a UserError naming the flag at fault; before anything is loaded."""
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"`lm-train serve` needs {' and '.join(missing)}: install lm-train[serve] "
                        "(pip install 'lm-train[serve]').")  # fmt: skip
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {port}.")
    if graceful_stop < 0:
        raise UserError(f"--graceful-stop must be >= 0 seconds (0: cancel what is in flight at once), got "
                        f"{graceful_stop}.")  # fmt: skip
    try:
        return config.check()
    except ValueError as e:
        key = str(e).split(" ")[0]
        flag = FLAGS.get(key, key.replace("_", "-"))
        raise UserError(f"--{flag}: {str(e).replace(key, flag, 1)}.") from None


def serve(
    source: str,
    config: EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    chat_template: str | None = None,
    name: str | None = None,
    lora: str | None = None,
    weights: str | None = None,
    graceful_stop: int = GRACEFUL_STOP_S,
) -> None:
    """Serve `source` at http://host:port/v1 until SIGTERM or Ctrl-C, then let what is in flight finish for up to
    `graceful_stop` seconds, cancel the rest and return."""
    import uvicorn

    from .engine import Engine
    from .server import ServedModel, build_app
    from .source import check_adapter_dir, check_weights_of, load_source

    config = check_serve_options(config, host, port, graceful_stop)
    if lora is not None:
        check_adapter_dir(lora)
    check_weights_of(Path(source), weights)
    loaded = load_source(source, chat_template=chat_template, name=name, lora=lora, weights=weights)
    try:
        engine = Engine(loaded.model, config, eos_token_id=loaded.eos_token_id, decode=loaded.decode)
    except ValueError as e:
        raise UserError(f"{source}: {e}.") from None
    eos = None if loaded.eos_token_id is None else loaded.tokenizer.id_to_token(loaded.eos_token_id)
    served = ServedModel(loaded.name, loaded.encode, loaded.decode, loaded.render_chat, eos)
    app = build_app(engine, served, api_key=api_key)
    print(
        f"serving {loaded.name} on http://{host}:{port}/v1 ({engine.pool.capacity} pages of {config.page_size} "
        f"tokens, up to {config.max_seqs} sequences at once)",
        flush=True,
    )
    http = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=graceful_stop)
    _clean_exit_server_class()(http).run()
    print("server stopped", flush=True)


def _clean_exit_server_class():
    import uvicorn

    class CleanExitServer(uvicorn.Server):
        """uvicorn's server, but SIGTERM is a normal stop (exit 0) rather than raised again once shut down."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    return CleanExitServer
