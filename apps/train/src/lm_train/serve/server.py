"""The OpenAI-compatible HTTP server: a thin Starlette app over the engine, which runs in its own thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Engine, ServerFullError
from .openai_api import (
    BodyError,
    Parsed,
    chat_logprobs,
    completion_logprobs,
    finished_choices,
    parse_chat,
    parse_completion,
    usage,
)
from .params import RequestError
from .requests import ChoiceOutput, Delta, Request
from .tokenizer_routes import json_body, tokenizer_routes

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """What the server needs besides the engine: the model's name and its text <-> token functions."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    render_chat: Callable[[list[dict]], list[int]]  # messages -> prompt ids (chat template, generation prompt)
    eos_token: str | None = None


def error(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None, **headers
) -> Response:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers or None)


def build_app(
    engine: Engine, served: ServedModel, *, api_key: str | None = None, manage_engine: bool = True
) -> Starlette:
    """The ASGI app: /health, /v1/models, /v1/completions, /v1/chat/completions; the engine's thread starts and
    stops with the app when manage_engine is set."""
    created = int(time.time())

    def token_text(token: int) -> str:
        return served.decode([token])

    def token_id_text(token: int) -> str:
        return f"token_id:{token}"

    def _namer(parsed: Parsed) -> Callable[[int], str]:
        # vLLM's extension: "token_id:N" names each token exactly, where texts of single tokens may collide.
        return token_id_text if parsed.tokens_as_ids else token_text

    def model_card() -> dict:
        return {"id": served.name, "object": "model", "created": created, "owned_by": "lm-train"}

    async def health(request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", **engine.stats()})

    async def models(request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request: HttpRequest) -> Response:
        name = request.path_params["model"]
        if name != served.name:
            return error(404, f"The model '{name}' does not exist; this server serves '{served.name}'",
                         "invalid_request_error", "model", "model_not_found")  # fmt: skip
        return JSONResponse(model_card())

    async def completions(request: HttpRequest) -> Response:
        return await _serve(request, chat=False)

    async def chat_completions(request: HttpRequest) -> Response:
        return await _serve(request, chat=True)

    async def _serve(request: HttpRequest, chat: bool) -> Response:
        body = await json_body(request, error)
        if isinstance(body, Response):
            return body
        try:
            if not isinstance(body.get("model"), str):
                raise BodyError("model is required: the name of the served model (see /v1/models)", "model")
            if body["model"] != served.name:
                return error(404, f"The model '{body['model']}' does not exist; this server serves '{served.name}'",
                             "invalid_request_error", "model", "model_not_found")  # fmt: skip
            context = engine.max_positions
            parsed = (
                parse_chat(body, served.render_chat, context)
                if chat
                else parse_completion(body, served.encode, context)
            )
            handles, queue = _submit(parsed)
        except BodyError as e:
            return error(422, str(e), "invalid_request_error", e.param)
        except RequestError as e:
            return error(400, str(e), "invalid_request_error", e.param)
        except ServerFullError as e:
            return error(429, f"The server is busy ({e}); retry shortly", "rate_limit_error", code="server_busy",
                         **{"Retry-After": "1"})  # fmt: skip
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if parsed.stream:
            return StreamingResponse(
                _stream(request, rid, parsed, handles, queue, chat), media_type="text/event-stream"
            )
        try:
            await _wait_all(request, handles, queue)
        except asyncio.CancelledError:
            _cancel(handles)
            raise
        return JSONResponse(_response(rid, parsed, handles, chat))

    def _submit(parsed: Parsed) -> tuple[list[Request], asyncio.Queue]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        handles: list[Request] = []
        try:
            for i, prompt in enumerate(parsed.prompts):

                def on_delta(delta: Delta, i: int = i) -> None:
                    with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
                        loop.call_soon_threadsafe(queue.put_nowait, (i, delta))

                handles.append(engine.submit(prompt, parsed.params, on_delta=on_delta))
        except BaseException:
            _cancel(handles)
            raise
        return handles, queue

    async def _wait_all(request: HttpRequest, handles: list[Request], queue: asyncio.Queue) -> None:
        remaining = len(handles) * handles[0].params.n
        while remaining:
            _, delta = await queue.get()
            remaining -= delta.finish_reason is not None
        for handle in handles:
            if handle.error is not None:
                raise handle.error

    def _response(rid: str, parsed: Parsed, handles: list[Request], chat: bool) -> dict:
        outputs = [h.wait(0) for h in handles]
        choices = []
        completion_tokens = 0
        for index, p, out in finished_choices(outputs):
            completion_tokens += len(out.tokens)
            choices.append(_choice(index, parsed, handles[p], out, chat))
        prompt_tokens = sum(len(h.prompt) for h in handles)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": served.name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def _choice(index: int, parsed: Parsed, handle: Request, out: ChoiceOutput, chat: bool) -> dict:
        if chat:
            logprobs = chat_logprobs(out.logprobs, _namer(parsed)) if out.logprobs is not None else None
            message = {"role": "assistant", "content": out.text}
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": out.finish_reason}
        text = out.text
        logprobs = None
        if parsed.echo:
            prompt_text = served.decode(handle.prompt)
            text = prompt_text + text
        if out.logprobs is not None:
            if parsed.echo:
                prompt = handle.prompt_logprobs[1:]  # its first entry stands for the first token: no log-prob
                logprobs = completion_logprobs([*prompt, *out.logprobs], _namer(parsed), handle.prompt[0])
            else:
                logprobs = completion_logprobs(out.logprobs, _namer(parsed))
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}

    async def _stream(
        request: HttpRequest, rid: str, parsed: Parsed, handles: list[Request], queue: asyncio.Queue, chat: bool
    ) -> AsyncIterator[str]:
        n = parsed.params.n
        remaining = len(handles) * n
        completion_tokens = 0
        created_at = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict], **extra) -> str:
            body = {"id": rid, "object": kind, "created": created_at, "model": served.name, "choices": choices}
            return f"data: {json.dumps({**body, **extra})}\n\n"

        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(handles) * n)])  # fmt: skip
            elif parsed.echo:
                for p, handle in enumerate(handles):
                    text = served.decode(handle.prompt)
                    yield chunk([{"index": p * n + c, "text": text, "logprobs": None, "finish_reason": None}
                                 for c in range(n)])  # fmt: skip
            while remaining:
                p, delta = await queue.get()
                handle = handles[p]
                if handle.error is not None:
                    failure = {"message": str(handle.error), "type": "server_error", "param": None, "code": None}
                    yield f"data: {json.dumps({'error': failure})}\n\n"
                    return
                remaining -= delta.finish_reason is not None
                completion_tokens += len(delta.tokens)
                index = p * n + delta.choice
                if chat:
                    logprobs = chat_logprobs(delta.logprobs, _namer(parsed)) if delta.logprobs is not None else None
                    content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
                    yield chunk([{"index": index, "delta": content, "logprobs": logprobs,
                                  "finish_reason": delta.finish_reason}])  # fmt: skip
                else:
                    logprobs = (
                        completion_logprobs(delta.logprobs, _namer(parsed)) if delta.logprobs is not None else None
                    )
                    yield chunk([{"index": index, "text": delta.text, "logprobs": logprobs,
                                  "finish_reason": delta.finish_reason}])  # fmt: skip
            if parsed.include_usage:
                prompt_tokens = sum(len(h.prompt) for h in handles)
                yield chunk([], usage=usage(prompt_tokens, completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            _cancel(handles)  # a client that went away frees its pages at the next step

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                engine.stop(cancel=True)

    async def check_key(request: HttpRequest, handler) -> Response:
        wrong = request.headers.get("authorization") != f"Bearer {api_key}"
        if api_key is not None and request.url.path != "/health" and wrong:
            return error(401, "Incorrect API key provided", "invalid_request_error", code="invalid_api_key")
        try:
            return await handler(request)
        except Exception as e:  # never let a request take the server down
            log.exception("request failed")
            return error(500, f"The server failed on this request: {type(e).__name__}: {e}", "server_error")

    def guarded(handler):
        async def endpoint(request: HttpRequest) -> Response:
            return await check_key(request, handler)

        return endpoint

    routes = [
        Route("/health", guarded(health), methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(one_model), methods=["GET"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        *tokenizer_routes(served, engine.max_positions, error, guarded),
    ]

    async def not_found(request: HttpRequest, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        message = f"{request.method} {request.url.path}: " + (
            "no such endpoint" if status == 404 else "method not allowed"
        )
        return error(status, message, "invalid_request_error")

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})


def _cancel(handles: list[Request]) -> None:
    for handle in handles:
        if not handle.done:
            handle.cancel()
