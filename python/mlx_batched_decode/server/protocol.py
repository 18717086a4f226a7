"""The OpenAI-style wire format of the server: request fields checked, response bodies built.

Requests are checked field by field before any work (``parse_request``); anything wrong is an
``APIError`` whose body is OpenAI's ``{"error": {"message", "type", "code"}}``. Response bodies
are mlx_lm.server's, key for key (``response_body``, ``usage_body``), so that a client sees the
same JSON from either server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

# The name mlx_lm.server gives the model it was started with.
DEFAULT_MODEL = "default_model"


class APIError(Exception):
    """An error answered to the client: HTTP ``status`` with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code}}


@dataclass
class Defaults:
    """The server's defaults for fields a request leaves out (its flags)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0


@dataclass
class CompletionRequest:
    """One checked request: ``kind`` is ``"text"`` (``prompt``) or ``"chat"`` (``messages``)."""

    kind: str
    model: str
    prompt: str = ""
    messages: list[dict] = field(default_factory=list)
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)


def _bad(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"{name} must be a number, got {value!r}", "invalid_type")
    if not low <= value <= high:
        raise _bad(f"{name} must be in [{low}, {high}], got {value}")
    return float(value)


def _integer(body: dict, name: str, default: Optional[int]) -> Optional[int]:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer, got {value!r}", "invalid_type")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"{what} must be a string, got {type(value).__name__}", "invalid_type")
    return value


def _message_content(content: Any, index: int) -> str:
    """A message's content as the chat template takes it: a string, or text parts joined (as
    mlx_lm.server's ``process_message_content``); ``None`` is empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise _bad(f"messages[{index}]: only 'text' content parts are served")
            parts.append(_text(part.get("text"), f"messages[{index}] text"))
        return "".join(parts)
    raise _bad(f"messages[{index}].content must be a string or a list of text parts")


def parse_request(body: Any, kind: str, defaults: Defaults) -> CompletionRequest:
    """A ``/v1/completions`` (``kind="text"``) or ``/v1/chat/completions`` (``"chat"``) body,
    checked: ``APIError`` 400 naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "invalid_type")
    model = body.get("model", DEFAULT_MODEL)
    request = CompletionRequest(kind=kind, model=_text(model, "model"))
    if kind == "text":
        if "prompt" not in body:
            raise _bad("the request needs a prompt", "missing_field")
        request.prompt = _text(body["prompt"], "prompt")
        if not request.prompt:
            raise _bad("the prompt is empty")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("the request needs messages: a non-empty list", "missing_field")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise _bad(f"messages[{i}] must be an object with a string role")
            request.messages.append(
                {"role": message["role"], "content": _message_content(message.get("content"), i)}
            )
        if body.get("tools"):
            raise _bad("tools are not served by this server", "unsupported_field")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs must be an object", "invalid_type")
        request.chat_template_kwargs = kwargs
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens", defaults.max_tokens)
    request.max_tokens = _integer({"max_tokens": max_tokens}, "max_tokens", None)
    if request.max_tokens is None or request.max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens!r}")
    request.temperature = _number(body, "temperature", defaults.temperature, 0.0, 100.0)
    request.top_p = _number(body, "top_p", defaults.top_p, 0.0, 1.0)
    if request.top_p == 0.0:
        raise _bad("top_p must be in (0, 1], got 0")
    request.seed = _integer(body, "seed", None)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop must be a string or a list of non-empty strings", "invalid_type")
    request.stop = stop
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad(f"stream must be a boolean, got {stream!r}", "invalid_type")
    request.stream = stream
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _bad("stream_options must be an object with a boolean include_usage")
    request.include_usage = options.get("include_usage", False)
    top_logprobs = body.get("top_logprobs")
    if body.get("logprobs") or (isinstance(top_logprobs, int) and top_logprobs > 0):
        raise _bad("logprobs are not served by this server", "unsupported_field")
    return request


@dataclass
class ResponseHeader:
    """What every body of one response repeats."""

    id: str
    system_fingerprint: str
    object: str
    model: str
    created: int


def response_body(
    header: ResponseHeader,
    chat: bool,
    stream: bool,
    text: str,
    finish_reason: Optional[str],
    reasoning: str = "",
    usage: Optional[dict] = None,
) -> dict:
    """One response (``stream=False``) or one stream chunk, as mlx_lm.server's
    ``generate_response`` builds it."""
    body: dict[str, Any] = {
        "id": header.id,
        "system_fingerprint": header.system_fingerprint,
        "object": header.object,
        "model": header.model,
        "created": header.created,
        "choices": [{"index": 0, "finish_reason": finish_reason}],
    }
    if usage is not None:
        body["usage"] = usage
    choice = body["choices"][0]
    if chat:
        key = "delta" if stream else "message"
        choice[key] = {"role": "assistant"}
        if not stream:
            # The schema requires "content", null when empty.
            choice[key]["content"] = text if text else None
        elif text:
            choice[key]["content"] = text
        if reasoning:
            choice[key]["reasoning"] = reasoning
    else:
        choice["text"] = text
    return body


def usage_counts(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """The ``usage`` object: token counts, and the prompt tokens taken from cached blocks."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_body(header: ResponseHeader, usage: dict) -> dict:
    """The stream's last chunk with ``stream_options.include_usage`` (mlx_lm.server names its
    object ``chat.completion`` for both endpoints)."""
    return {
        "id": header.id,
        "system_fingerprint": header.system_fingerprint,
        "object": "chat.completion",
        "model": header.model,
        "created": header.created,
        "choices": [],
        "usage": usage,
    }

