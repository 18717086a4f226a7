"""Response bodies: mlx_lm.server's, key for key, and OpenAI's where it has none (logprobs,
several choices).

A body without logprobs is exactly mlx_lm.server's (``response_body``, ``usage_body``), so
that a client sees the same JSON from either server. Logprobs take OpenAI's shapes: a chat
choice's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``, a completion
choice's legacy ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

# What OpenAI reports for a token the distribution rules out: JSON has no -Infinity.
_NO_LOGPROB = -9999.0


@dataclass
class ResponseHeader:
    """What every body of one response repeats."""

    id: str
    system_fingerprint: str
    object: str
    model: str
    created: int


@dataclass
class ChoiceBody:
    """One choice of a body: its ``text`` (a stream chunk's: what it adds), ``reasoning``,
    ``finish_reason``, built ``logprobs`` object (``None``: the key is left out, as
    mlx_lm.server leaves it) and ``tool_calls`` (OpenAI's, built by ``tools.ToolCalls``)."""

    index: int
    text: str
    finish_reason: Optional[str] = None
    reasoning: str = ""
    logprobs: Optional[dict] = None
    tool_calls: list = field(default_factory=list)


@dataclass
class LogprobRow:
    """One token's logprob as reported: ``logprob`` and ``top`` (best first, token ids with
    their logprobs) are ``None`` for a prompt's first token, which nothing predicts."""

    token: int
    logprob: Optional[float]
    top: Optional[Sequence[tuple[int, float]]]


class TokenTexts:
    """Each token's text as logprobs report it: the tokenizer's decode of that one id."""

    def __init__(self, tokenizer: Any):
        self._decode = tokenizer.decode
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._decode([token])
        return text


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _NO_LOGPROB


def chat_logprobs(rows: Sequence[LogprobRow], texts: TokenTexts) -> dict:
    """A chat choice's (or chunk's) ``logprobs``: one entry per generated token."""

    def entry(token: int, logprob: float) -> dict:
        text = texts(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(row.token, row.logprob),
             "top_logprobs": [entry(t, lp) for t, lp in row.top or ()]}
            for row in rows
        ]
    }


def completion_logprobs(
    rows: Sequence[LogprobRow], texts: TokenTexts, offsets: Sequence[int]
) -> dict:
    """A completion choice's (or chunk's) legacy ``logprobs``; ``offsets``: where each token's
    text starts in the choice's text (``text_offset``)."""
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                             "text_offset": []}
    for row, offset in zip(rows, offsets):
        text = texts(row.token)
        body["tokens"].append(text)
        body["token_logprobs"].append(None if row.logprob is None else _finite(row.logprob))
        body["top_logprobs"].append(
            None if row.top is None else {texts(t): _finite(lp) for t, lp in row.top}
        )
        body["text_offset"].append(offset)
    return body


def response_body(
    header: ResponseHeader,
    chat: bool,
    stream: bool,
    choices: Sequence[ChoiceBody],
    usage: Optional[dict] = None,
) -> dict:
    """One response (``stream=False``) or one stream chunk, as mlx_lm.server's
    ``generate_response`` builds it, with a choice for each of ``choices``."""
    body: dict[str, Any] = {
        "id": header.id,
        "system_fingerprint": header.system_fingerprint,
        "object": header.object,
        "model": header.model,
        "created": header.created,
        "choices": [_choice(choice, chat, stream) for choice in choices],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def _choice(choice: ChoiceBody, chat: bool, stream: bool) -> dict:
    out: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason}
    if chat:
        key = "delta" if stream else "message"
        message = out[key] = {"role": "assistant"}
        if not stream:
            # The schema requires "content", null when empty.
            message["content"] = choice.text if choice.text else None
        elif choice.text:
            message["content"] = choice.text
        if choice.reasoning:
            message["reasoning"] = choice.reasoning
        if choice.tool_calls:
            message["tool_calls"] = choice.tool_calls
    else:
        out["text"] = choice.text
    if choice.logprobs is not None:
        out["logprobs"] = choice.logprobs
    return out


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
