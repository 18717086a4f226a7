"""The HTTP side: a Starlette app whose handlers check requests and read the decoding thread.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (and ``/chat/completions``, as
mlx_lm.server), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. A request is checked,
tokenized and measured against the context length and the KV budget before it is submitted;
every error is OpenAI's error body, routing errors included. Bodies are written with
``json.dumps`` as mlx_lm.server writes them, so the bytes match its own.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .engine import Engine, Submission
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    CompletionRequest,
    Defaults,
    ResponseHeader,
    parse_request,
    response_body,
    usage_body,
)
from .text_stream import Piece, TextStream

# How often a request answered whole looks for its client having hung up.
_DISCONNECT_CHECK_S = 0.5
_NO_PIECE = object()
# The largest request body read: far above any prompt a context holds.
_MAX_BODY_BYTES = 64 << 20
# mlx_lm.server's CORS headers, on every response.
_CORS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "*",
    "Access-Control-Allow-Headers": "*",
}


@dataclass
class ServerState:
    """What the handlers share: the model's tokenizer and names, the engine, the limits.

    ``model_names``: the names a request's ``model`` may take. ``context_length``: the most
    positions a request may reach (prompt + ``max_tokens``). ``chat_template_args``: keywords
    for every ``apply_chat_template``. ``stop_timeout``: seconds the shutdown waits for the
    decoding thread."""

    engine: Engine
    tokenizer: Any
    metrics: ServerMetrics
    model_id: str
    model_names: set[str]
    context_length: int
    defaults: Defaults = field(default_factory=Defaults)
    chat_template_args: dict = field(default_factory=dict)
    fingerprint: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    stop_timeout: float = 30.0


def _json(body: Any, status: int = 200, headers: Optional[dict] = None) -> Response:
    return Response(
        json.dumps(body).encode(), status, {**_CORS, **(headers or {})}, "application/json"
    )


def _sse(body: Any) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def _tokenize(state: ServerState, request: CompletionRequest) -> tuple[list[int], str]:
    """The prompt's token ids and the text state it starts in, as mlx_lm.server tokenizes."""
    tokenizer = state.tokenizer
    if request.kind == "text":
        return tokenizer.encode(request.prompt), "normal"
    if not tokenizer.has_chat_template:
        from mlx_lm.server import convert_chat

        return tokenizer.encode(convert_chat(request.messages)), "normal"
    try:
        prompt = tokenizer.apply_chat_template(
            request.messages,
            add_generation_prompt=True,
            tools=None,
            tokenize=True,
            **{**state.chat_template_args, **request.chat_template_kwargs},
        )
    except Exception as error:  # noqa: BLE001 - a template's failure is the request's fault
        raise APIError(400, f"the chat template failed on these messages: {error}") from error
    # A prompt that opens a thinking block and leaves it open starts the answer in it.
    thinking = tokenizer.has_thinking and (
        tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)
    )
    initial = "reasoning" if thinking else "normal"
    return list(prompt), tokenizer.response_initial_state or initial


def _submission(state: ServerState, request: CompletionRequest) -> Submission:
    """The request tokenized and checked against the limits: ``APIError`` 400 before any work."""
    if request.model not in state.model_names:
        raise APIError(
            404,
            f"the model {request.model!r} does not exist: this server serves "
            f"{state.model_id!r} (also named 'default_model', or leave model out)",
            code="model_not_found",
        )
    prompt, initial_state = _tokenize(state, request)
    if not prompt:
        raise APIError(400, "the prompt has no tokens", code="invalid_value")
    if len(prompt) + request.max_tokens > state.context_length:
        raise APIError(
            400,
            f"the prompt's {len(prompt)} tokens and max_tokens={request.max_tokens} exceed the "
            f"model's context length of {state.context_length} tokens",
            code="context_length_exceeded",
        )
    try:
        # Reads only the engine's configuration: safe beside the decoding thread.
        state.engine.core.check_request(len(prompt), request.max_tokens)
    except ValueError as error:
        raise APIError(400, str(error), code="kv_budget_exceeded") from error
    stream = TextStream(state.tokenizer, request.stop, request.max_tokens, initial_state)
    return Submission(
        prompt, request.max_tokens, request.temperature, request.top_p, request.seed, stream,
        asyncio.get_running_loop(), stop_tokens=tuple(state.tokenizer.eos_token_ids),
    )


async def _read_body(request: Request) -> Any:
    """The JSON body, read up to ``_MAX_BODY_BYTES`` (413 past it)."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > _MAX_BODY_BYTES:
            raise APIError(413, f"the request body exceeds {_MAX_BODY_BYTES} bytes",
                           code="body_too_large")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise APIError(400, f"invalid JSON in the request body: {error}", code="invalid_json")


def _header(request: CompletionRequest, state: ServerState) -> ResponseHeader:
    chat = request.kind == "chat"
    if chat:
        name, kind = "chatcmpl", "chat.completion.chunk" if request.stream else "chat.completion"
    else:
        name, kind = "cmpl", "text_completion"
    return ResponseHeader(
        f"{name}-{uuid.uuid4()}", state.fingerprint, kind, request.model, int(time.time())
    )


async def _events(
    state: ServerState, request: CompletionRequest, submission: Submission
) -> AsyncIterator[bytes]:
    """The stream: a chunk whenever a token adds text (mlx_lm.server's rule), the last chunk
    with ``finish_reason``, the usage chunk if asked for, ``[DONE]``."""
    header, chat = _header(request, state), request.kind == "chat"
    text = reasoning = ""
    finish = None
    try:
        while (piece := await submission.pieces.get()) is not None:
            text, reasoning = text + piece.text, reasoning + piece.reasoning
            if piece.state != "tool" and (text or reasoning):
                yield _sse(response_body(header, chat, True, text, None, reasoning))
                text = reasoning = ""
            finish = piece.finish_reason or finish
        if submission.error is not None:
            yield _sse(APIError(500, submission.error, "server_error").body())
            return
        yield _sse(response_body(header, chat, True, text, finish, reasoning))
        if request.include_usage:
            yield _sse(usage_body(header, submission.usage()))
        yield b"data: [DONE]\n\n"
    finally:
        # A client that hung up (the stream is closed early) ends its request.
        state.engine.cancel(submission)


async def _collect(http: Request, state: ServerState, submission: Submission) -> list[Piece]:
    """Every piece of a request answered whole; ``[]`` if its client hung up first (checked
    every ``_DISCONNECT_CHECK_S``, however fast its pieces come)."""
    loop = asyncio.get_running_loop()
    pieces, next_check = [], loop.time() + _DISCONNECT_CHECK_S
    try:
        while True:
            try:
                timeout = max(0.0, next_check - loop.time())
                piece = await asyncio.wait_for(submission.pieces.get(), timeout)
            except asyncio.TimeoutError:
                piece = _NO_PIECE
            if loop.time() >= next_check:
                if await http.is_disconnected():
                    state.engine.cancel(submission)
                    return []
                next_check = loop.time() + _DISCONNECT_CHECK_S
            if piece is None:
                return pieces
            if piece is not _NO_PIECE:
                pieces.append(piece)
    except asyncio.CancelledError:
        state.engine.cancel(submission)
        raise


def _completion_route(kind: str):
    async def handle(http: Request) -> Response:
        state: ServerState = http.app.state.server
        try:
            request = parse_request(await _read_body(http), kind, state.defaults)
            submission = _submission(state, request)
            state.engine.submit(submission)
        except APIError as error:
            state.metrics.rejected.labels(str(error.status)).inc()
            return _json(error.body(), error.status, error.headers)
        if request.stream:
            headers = {**_CORS, "Cache-Control": "no-cache"}
            return StreamingResponse(
                _events(state, request, submission), headers=headers,
                media_type="text/event-stream",
            )
        pieces = await _collect(http, state, submission)
        if submission.error is not None:
            return _json(APIError(500, submission.error, "server_error").body(), 500)
        finish = next((p.finish_reason for p in reversed(pieces) if p.finish_reason), None)
        body = response_body(
            _header(request, state),
            kind == "chat",
            False,
            "".join(p.text for p in pieces),
            finish,
            "".join(p.reasoning for p in pieces),
            submission.usage(),
        )
        return _json(body)

    return handle


async def _models(http: Request) -> Response:
    state: ServerState = http.app.state.server
    model = {"id": state.model_id, "object": "model", "created": state.created}
    return _json({"object": "list", "data": [model]})


async def _health(http: Request) -> Response:
    alive = http.app.state.server.engine.alive
    return _json({"status": "ok" if alive else "unavailable"}, 200 if alive else 503)


async def _metrics(http: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(http.app.state.server.metrics.text(), media_type=CONTENT_TYPE_LATEST)


async def _http_error(http: Request, error: HTTPException) -> Response:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    body = APIError(error.status_code, f"{http.method} {http.url.path}: {error.detail}", kind)
    return _json(body.body(), error.status_code)


async def _server_error(http: Request, error: Exception) -> Response:
    return _json(APIError(500, f"internal error: {error}", "server_error").body(), 500)


def create_app(state: ServerState) -> Starlette:
    """The app serving ``state``; its lifespan starts the decoding thread and, at shutdown,
    lets the requests it holds end before it stops."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.engine.start()
        yield
        await asyncio.to_thread(state.engine.stop, state.stop_timeout)

    routes = [
        Route("/v1/completions", _completion_route("text"), methods=["POST"]),
        Route("/v1/chat/completions", _completion_route("chat"), methods=["POST"]),
        Route("/chat/completions", _completion_route("chat"), methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.state.server = state
    return app
