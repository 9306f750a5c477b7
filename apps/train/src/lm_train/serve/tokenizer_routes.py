"""vLLM's tokenizer endpoints (/tokenizer_info, /tokenize, /detokenize), which lm-eval's `remote` tokenizer reads,
so that lm-eval scores through the server without a tokenizer of its own."""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


async def json_body(request: HttpRequest, error: Callable[..., Response]) -> dict | Response:
    """The request's JSON object, or the 400 answer that says what is wrong with it."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return error(400, f"The body is not valid JSON: {e}", "invalid_request_error")
    if not isinstance(body, dict):
        return error(400, "The body must be a JSON object", "invalid_request_error")
    return body


def tokenizer_routes(served, context: int, error: Callable[..., Response], guarded: Callable) -> list[Route]:
    """The three routes, answering in vLLM's shapes; `guarded` wraps each (the key check, errors as JSON)."""

    async def info(request: HttpRequest) -> Response:
        return JSONResponse({"eos_token": served.eos_token, "bos_token": None, "pad_token": None,
                             "model_max_length": context})  # fmt: skip

    async def tokenize(request: HttpRequest) -> Response:
        body = await json_body(request, error)
        if isinstance(body, Response):
            return body
        if not isinstance(body.get("prompt"), str):
            return error(422, "prompt must be a string", "invalid_request_error", "prompt")
        tokens = served.encode(body["prompt"])
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": context})

    async def detokenize(request: HttpRequest) -> Response:
        body = await json_body(request, error)
        if isinstance(body, Response):
            return body
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            return error(422, "tokens must be an array of integers", "invalid_request_error", "tokens")
        return JSONResponse({"prompt": served.decode(tokens)})

    return [
        Route("/tokenizer_info", guarded(info), methods=["GET"]),
        Route("/tokenize", guarded(tokenize), methods=["POST"]),
        Route("/detokenize", guarded(detokenize), methods=["POST"]),
    ]
