"""The HTTP side: a Starlette app whose handlers check requests and read the decoding thread.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (and ``/chat/completions``, as
mlx_lm.server), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``;
``OPTIONS`` on each answers a CORS preflight, and every response carries the CORS headers. A
request is checked, tokenized (on a thread of its own, off the event loop) and measured
against the vocabulary, the context length and the KV budget before it is submitted: one
submission per prompt, each with its ``n`` choices. Every error is OpenAI's error body,
routing errors included. Bodies are written with ``json.dumps`` as mlx_lm.server writes them,
so the bytes match its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..decoding.sampling_params import SamplingParams
from .answer import Answer, Prompt
from .engine import Choice, Engine, PromptRows, Submission, usage
from .fields import parse_request
from .metrics import ServerMetrics
from .protocol import APIError, CompletionRequest, Defaults
from .responses import ResponseHeader, TokenTexts, response_body, usage_body
from .text_stream import TextStream

log = logging.getLogger("mlx_batched_decode.server")

# How often a request answered whole looks for its client having hung up.
_DISCONNECT_CHECK_S = 0.5
# The largest request body read: far above any prompt a context holds.
_MAX_BODY_BYTES = 64 << 20


@dataclass
class ServerState:
    """What the handlers share: the model's tokenizer and names, the engine, the limits.

    ``model_names``: the names a request's ``model`` may take. ``vocab_size``: the logits a
    token gets (token ids and ``logit_bias`` ids are below it). ``context_length``: the most
    positions a request may reach (prompt + ``max_tokens``). ``chat_template_args``: keywords
    for every ``apply_chat_template``. ``allowed_origins``: the CORS origins (``"*"``: any).
    ``keepalive_s``: how long a stream stays silent before a comment keeps it open.
    ``stop_timeout``: seconds the shutdown waits for the decoding thread. ``grammars``: the
    engine's ``GrammarCompiler``, which checks a request's constraint before it is accepted
    (``None``: none could be made, and constrained requests are refused)."""

    engine: Engine
    tokenizer: Any
    metrics: ServerMetrics
    model_id: str
    model_names: set[str]
    vocab_size: int
    context_length: int
    defaults: Defaults = field(default_factory=Defaults)
    chat_template_args: dict = field(default_factory=dict)
    allowed_origins: Sequence[str] = ("*",)
    keepalive_s: float = 5.0
    fingerprint: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    stop_timeout: float = 30.0
    grammars: Optional[Any] = None

    def __post_init__(self) -> None:
        # One thread: tokenizers are not all safe to call from several at once.
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="mbd-tokenize")
        self.token_texts = TokenTexts(self.tokenizer)
        # What XTC never removes, as mlx_lm.server passes it: a newline and the end tokens.
        self.xtc_special_tokens = (
            *self.tokenizer.encode("\n"), *self.tokenizer.eos_token_ids
        )


def _json(body: Any, status: int = 200, headers: Optional[dict] = None) -> Response:
    return Response(json.dumps(body).encode(), status, headers, "application/json")


def _sse(body: Any) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def _chat_prompt(state: ServerState, request: CompletionRequest) -> Prompt:
    """The chat's prompt, as mlx_lm.server templates it."""
    tokenizer = state.tokenizer
    if not tokenizer.has_chat_template:
        from mlx_lm.server import convert_chat

        return Prompt(tokenizer.encode(convert_chat(request.messages)), "")
    if request.tools.tools and not tokenizer.has_tool_calling:
        log.warning("tools offered to a model whose tokenizer has no tool-call format: "
                    "its answers are not parsed for calls")
    try:
        prompt = tokenizer.apply_chat_template(
            request.messages,
            add_generation_prompt=True,
            tools=request.tools.tools,
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
    return Prompt(list(prompt), "", tokenizer.response_initial_state or initial)


def _check_constraint(state: ServerState, request: CompletionRequest) -> None:
    """400 naming the field unless the request's constraint compiles (the compiler caches it
    for the engine); run on the tokenizing thread, as compiling may take a while."""
    constraint = request.constraint
    if constraint is None:
        return
    if state.grammars is None:
        raise APIError(400, f"{constraint.field}: this server has no structured output "
                       "(llguidance is not installed, or cannot read the model's tokenizer: "
                       "its log says which)", code="unsupported_field")
    try:
        state.grammars.check(constraint.spec)
    except ValueError as error:
        raise APIError(400, f"{constraint.field}: {error}", code="invalid_value") from None


def _tokenize(state: ServerState, request: CompletionRequest) -> list[Prompt]:
    """Each prompt's token ids, as mlx_lm.server tokenizes, and the request's constraint
    checked (on the tokenizing thread)."""
    _check_constraint(state, request)
    if request.kind == "chat":
        return [_chat_prompt(state, request)]
    prompts = []
    for i, prompt in enumerate(request.prompts):
        if isinstance(prompt, str):
            prompts.append(Prompt(state.tokenizer.encode(prompt), prompt))
            continue
        if max(prompt) >= state.vocab_size:
            what = "prompt" if len(request.prompts) == 1 else f"prompt[{i}]"
            raise APIError(400, f"{what}: token id {max(prompt)} is not below the vocabulary's "
                           f"{state.vocab_size}", code="invalid_value")
        prompts.append(Prompt(list(prompt), state.tokenizer.decode(prompt)))
    return prompts


def _sampling(state: ServerState, request: CompletionRequest) -> SamplingParams:
    """The request's sampling, checked (400 naming the knob), token ids against the
    vocabulary included; each choice samples from its own stream of the seed."""
    knobs = dict(request.sampling)
    if knobs["top_k"] >= state.vocab_size:
        knobs["top_k"] = 0  # keeps every token, as 0 does
    try:
        params = SamplingParams(seed=request.seed, logprobs=request.logprobs,
                                xtc_special_tokens=state.xtc_special_tokens, **knobs)
        params.check_vocab(state.vocab_size)
    except ValueError as error:
        raise APIError(400, str(error), code="invalid_value") from error
    return params


async def _submissions(
    state: ServerState, request: CompletionRequest, queue: asyncio.Queue
) -> tuple[list[Submission], list[Prompt]]:
    """The request tokenized and checked against the limits, one submission per prompt
    sharing ``queue``: ``APIError`` 400 before any work."""
    if request.model not in state.model_names:
        raise APIError(
            404,
            f"the model {request.model!r} does not exist: this server serves "
            f"{state.model_id!r} (also named 'default_model', or leave model out)",
            code="model_not_found",
        )
    loop = asyncio.get_running_loop()
    try:
        prompts = await loop.run_in_executor(state.tokenizing, _tokenize, state, request)
    except APIError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the tokenizer makes of the input
        raise APIError(400, f"the prompt could not be tokenized: {error}") from error
    params, submissions = _sampling(state, request), []
    for p, prompt in enumerate(prompts):
        if not prompt.ids:
            raise APIError(400, "the prompt has no tokens", code="invalid_value")
        if len(prompt.ids) + request.max_tokens > state.context_length:
            raise APIError(
                400,
                f"the prompt's {len(prompt.ids)} tokens and max_tokens={request.max_tokens} "
                f"exceed the model's context length of {state.context_length} tokens",
                code="context_length_exceeded",
            )
        try:
            # Reads only the engine's configuration: safe beside the decoding thread.
            state.engine.core.check_request(len(prompt.ids), request.max_tokens, request.n)
        except ValueError as error:
            raise APIError(400, str(error), code="kv_budget_exceeded") from error
        choices = [
            Choice(p * request.n + j, TextStream(
                state.tokenizer, request.stop, request.max_tokens, prompt.initial_state,
                tool_calls=request.tools.parsed))
            for j in range(request.n)
        ]
        # An echo with logprobs reports the prompt's tokens too.
        prompt_logprobs = request.logprobs if request.echo else None
        submissions.append(Submission(
            prompt.ids, request.max_tokens, choices, params, loop, queue,
            stop_tokens=tuple(state.tokenizer.eos_token_ids), prompt_logprobs=prompt_logprobs,
            grammar=request.constraint and request.constraint.spec,
            grammar_after=_grammar_after(state, prompt),
        ))
    return submissions, prompts


def _grammar_after(state: ServerState, prompt: Prompt) -> Optional[int]:
    """Where a constraint starts: after the thinking section the prompt left open (at its end
    token), else at the first token."""
    if prompt.initial_state != "reasoning":
        return None
    try:
        return state.tokenizer.think_end_id
    except ValueError:  # an end of thinking of several tokens: no single token starts it
        return None


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
    except RecursionError:
        raise APIError(400, "invalid JSON in the request body: it nests too deeply",
                       code="invalid_json") from None


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
    state: ServerState,
    request: CompletionRequest,
    submissions: list[Submission],
    prompts: list[Prompt],
) -> AsyncIterator[bytes]:
    """The stream: for each choice a chunk whenever a token adds text (mlx_lm.server's rule),
    then its chunk with ``finish_reason``; the usage chunk if asked for, ``[DONE]``. A comment
    keeps the connection open while nothing comes (the request waits or feeds its prompt)."""
    header, chat = _header(request, state), request.kind == "chat"
    answer = Answer(state.token_texts, request, prompts, state.tokenizer.tool_parser)
    queue, ended = submissions[0].pieces, 0
    try:
        while ended < len(submissions):
            try:
                item = await asyncio.wait_for(queue.get(), state.keepalive_s)
            except asyncio.TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if item is None:
                ended += 1
                continue
            answer.add(item)
            if isinstance(item, PromptRows):
                continue
            i = item.index
            if (echo := answer.echo(i)) is not None:
                yield _sse(response_body(header, chat, True, [echo]))
            if item.state != "tool" and answer.ready(i):
                yield _sse(response_body(header, chat, True, [answer.take(i)]))
            if item.finish_reason is not None:
                yield _sse(response_body(header, chat, True, [answer.take(i, finish=True)]))
        error = next((s.error for s in submissions if s.error is not None), None)
        if error is not None:
            yield _sse(APIError(500, error, "server_error").body())
            return
        if request.include_usage:
            yield _sse(usage_body(header, usage(submissions)))
        yield b"data: [DONE]\n\n"
    finally:
        # A client that hung up (the stream is closed early) ends its request.
        for submission in submissions:
            state.engine.cancel(submission)


async def _collect(
    http: Request, state: ServerState, submissions: list[Submission]
) -> Optional[list]:
    """Every piece of a request answered whole; ``None`` if its client hung up first (checked
    every ``_DISCONNECT_CHECK_S``, however fast its pieces come)."""
    loop = asyncio.get_running_loop()
    queue, items, ended = submissions[0].pieces, [], 0
    next_check = loop.time() + _DISCONNECT_CHECK_S
    try:
        while ended < len(submissions):
            try:
                timeout = max(0.0, next_check - loop.time())
                item = await asyncio.wait_for(queue.get(), timeout)
            except asyncio.TimeoutError:
                item = False
            if loop.time() >= next_check:
                if await http.is_disconnected():
                    for submission in submissions:
                        state.engine.cancel(submission)
                    return None
                next_check = loop.time() + _DISCONNECT_CHECK_S
            if item is None:
                ended += 1
            elif item is not False:
                items.append(item)
        return items
    except asyncio.CancelledError:
        for submission in submissions:
            state.engine.cancel(submission)
        raise


def _completion_route(kind: str):
    async def handle(http: Request) -> Response:
        state: ServerState = http.app.state.server
        try:
            request = parse_request(await _read_body(http), kind, state.defaults)
            submissions, prompts = await _submissions(state, request, asyncio.Queue())
            state.engine.submit(submissions)
        except APIError as error:
            state.metrics.rejected.labels(str(error.status)).inc()
            return _json(error.body(), error.status, error.headers)
        if request.stream:
            return StreamingResponse(
                _events(state, request, submissions, prompts),
                headers={"Cache-Control": "no-cache"}, media_type="text/event-stream",
            )
        items = await _collect(http, state, submissions)
        error = next((s.error for s in submissions if s.error is not None), None)
        if error is not None:
            return _json(APIError(500, error, "server_error").body(), 500)
        answer = Answer(state.token_texts, request, prompts, state.tokenizer.tool_parser)
        for item in items or ():
            answer.add(item)
        choices = [answer.whole(i) for i in range(len(answer.text))]
        body = response_body(_header(request, state), kind == "chat", False, choices,
                             usage(submissions))
        return _json(body)

    return handle


def _model(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.created}


async def _models(http: Request) -> Response:
    return _json({"object": "list", "data": [_model(http.app.state.server)]})


async def _one_model(http: Request) -> Response:
    state: ServerState = http.app.state.server
    name = http.path_params["name"]
    if name not in state.model_names:
        error = APIError(404, f"The model {name!r} does not exist", code="model_not_found")
        return _json(error.body(), 404)
    return _json(_model(state))


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


def _route(path: str, endpoint, method: str) -> Route:
    """``endpoint`` for ``method`` at ``path``, and ``OPTIONS`` there: a CORS preflight."""

    async def handle(http: Request) -> Response:
        if http.method == "OPTIONS":
            return Response(status_code=204)
        return await endpoint(http)

    return Route(path, handle, methods=[method, "OPTIONS"])


class _CORS:
    """Adds mlx_lm.server's CORS headers to every response: ``Access-Control-Allow-Origin``
    ``*`` (or the request's ``Origin`` if it is one of ``allowed``), methods and headers
    ``*``."""

    def __init__(self, app, allowed: Sequence[str]):
        self.app, self.allowed = app, list(allowed)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = [(b"access-control-allow-methods", b"*"), (b"access-control-allow-headers", b"*")]
        origin = dict(scope["headers"]).get(b"origin", b"").decode("latin-1")
        if "*" in self.allowed:
            extra.append((b"access-control-allow-origin", b"*"))
        elif origin in self.allowed:
            extra += [(b"access-control-allow-origin", origin.encode("latin-1")),
                      (b"vary", b"Origin")]

        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)


def create_app(state: ServerState) -> Starlette:
    """The app serving ``state``; its lifespan starts the decoding thread and, at shutdown,
    lets the requests it holds end before it stops."""
    from starlette.middleware import Middleware

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.engine.start()
        yield
        await asyncio.to_thread(state.engine.stop, state.stop_timeout)
        state.tokenizing.shutdown(wait=False)

    routes = [
        _route("/v1/completions", _completion_route("text"), "POST"),
        _route("/v1/chat/completions", _completion_route("chat"), "POST"),
        _route("/chat/completions", _completion_route("chat"), "POST"),
        _route("/v1/models", _models, "GET"),
        # A model's id may hold slashes (an org/name repo id, a folder path).
        _route("/v1/models/{name:path}", _one_model, "GET"),
        _route("/health", _health, "GET"),
        _route("/metrics", _metrics, "GET"),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(_CORS, allowed=state.allowed_origins)],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.state.server = state
    return app
