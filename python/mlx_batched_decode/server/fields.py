"""A request body's fields, each checked before any work: served, refused by name, or ignored.

``parse_request`` reads every field OpenAI's API and mlx_lm.server define for
``/v1/completions`` and ``/v1/chat/completions`` (mlx_lm.server's defaults where it has them);
any value it cannot serve is an ``APIError`` 400 whose message names the field: a wrong type
(a boolean is no number), a number out of range or not finite, a lone surrogate in any string,
nesting deeper than ``MAX_DEPTH``. A field that would change what the answer means or how it
is shaped and that the server does not serve (``REFUSED``) is a 400 naming it unless its value
asks for nothing; any other field is ignored, as mlx_lm.server ignores it.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional

from .protocol import DEFAULT_MODEL, APIError, CompletionRequest, Defaults
from .structured import parse_constraint
from .tools import parse_tools

# The deepest a body may nest (a chat's content parts sit at depth 5).
MAX_DEPTH = 64
# The most choices one request asks for (prompts x n); --max-batch-size bounds n too.
MAX_CHOICES = 16
# The most alternatives a reported token comes with (OpenAI's top_logprobs bound).
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
_INT32_MAX = 2**31 - 1
_SEED_RANGE = (-(2**63), 2**64)


def _nothing(value: Any) -> bool:
    return value is None


def _one(value: Any) -> bool:
    return value is None or (type(value) is int and value == 1)


# Fields of OpenAI's API (and vLLM's and mlx_lm.server's) the server does not serve, each with
# the test of a value that asks for nothing: any other value is refused by name.
REFUSED: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v in ("none", "auto"),
    "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "suffix": lambda v: v is None or v == "",
    "best_of": _one,
    "prediction": _nothing,
    "audio": _nothing,
    "modalities": lambda v: v is None or v == ["text"],
    "web_search_options": _nothing,
    "reasoning_effort": _nothing,
    "min_tokens": lambda v: v is None or (type(v) is int and v == 0),
    "ignore_eos": lambda v: v is None or v is False,
    "adapters": _nothing,
    "draft_model": lambda v: v is None or v == DEFAULT_MODEL,
}

# The sampling knobs: (field, the Sampler keyword's default, low, high); the defaults are
# mlx_lm.server's. temperature, top_p, top_k and min_p default to the server's flags.
_FLOAT_KNOBS = [
    ("min_p", None, 0.0, 1.0),
    ("repetition_penalty", 0.0, 0.0, 100.0),
    ("presence_penalty", 0.0, -100.0, 100.0),
    ("frequency_penalty", 0.0, -100.0, 100.0),
    ("xtc_probability", 0.0, 0.0, 1.0),
    ("xtc_threshold", 0.1, 0.0, 0.5),
]
_INT_KNOBS = [
    ("top_k", None, 0, _INT32_MAX),
    ("repetition_context_size", 20, 0, _INT32_MAX),
    ("presence_context_size", 20, 0, _INT32_MAX),
    ("frequency_context_size", 20, 0, _INT32_MAX),
]


def _bad(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code)


def _shown(value: Any) -> str:
    """``value`` for a message: short, whatever its size."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {value.bit_length()} bits"
    return f"{value!r:.80}"


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{name} must be a number, got {_shown(value)}", "invalid_type")
    # Compared before any conversion: a huge int is out of range, not an overflow.
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(f"{name} must be finite, got {value}")
    if not low <= value <= high:
        raise _bad(f"{name} must be in [{low}, {high}], got {_shown(value)}")
    return float(value)


def _integer(body: dict, name: str, default: Optional[int], low: int, high: int) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer, got {_shown(value)}", "invalid_type")
    if not low <= value <= high:
        raise _bad(f"{name} must be in [{low}, {high}], got {_shown(value)}")
    return value


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean, got {_shown(value)}", "invalid_type")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"{what} must be a string, got {type(value).__name__}", "invalid_type")
    return value


def check_strings(body: Any) -> None:
    """400 for nesting deeper than ``MAX_DEPTH`` or a string (or key) that is no UTF-8 text
    (a lone surrogate, which JSON's ``\\ud800`` escapes allow), naming where it is. Walked
    without recursion, whatever the depth."""
    pending = [(body, "body", 0)]
    while pending:
        value, where, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise _bad(f"{where}: the body nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise _bad(f"{where} holds a lone surrogate: it is not UTF-8 text") from None
        elif isinstance(value, list):
            pending += [(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
        elif isinstance(value, dict):
            for key, item in value.items():
                name = key if where == "body" else f"{where}.{key}"
                pending += [(key, f"{where} (a key)", depth + 1), (item, name, depth + 1)]


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


def _token_ids(value: list, what: str) -> list[int]:
    if not value:
        raise _bad(f"{what} is empty")
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= _INT32_MAX:
            raise _bad(f"{what} must hold token ids (integers >= 0), got {_shown(token)}",
                       "invalid_type")
    return value


def _prompts(prompt: Any) -> list:
    """A completion's ``prompt``: a string, token ids, or a list of either (one each)."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    elif isinstance(prompt, list):
        raise _bad("prompt is empty")
    else:
        raise _bad("prompt must be a string, token ids, or a list of either", "invalid_type")
    for i, one in enumerate(prompts):
        what = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(one, str):
            if not one:
                raise _bad(f"{what} is empty")
        elif isinstance(one, list):
            _token_ids(one, what)
        else:
            raise _bad(f"{what} must be a string or token ids", "invalid_type")
    return prompts


def _tool_calls(calls: Any, index: int) -> list[dict]:
    """An assistant message's ``tool_calls`` as mlx_lm.server hands them to the chat template:
    each function's ``arguments`` JSON text read into its value."""
    if not isinstance(calls, list):
        raise _bad(f"messages[{index}].tool_calls must be a list", "invalid_type")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where} must be an object whose function has a string name")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except ValueError as error:
                raise _bad(f"{where}.function.arguments is no JSON: {error}") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _messages(body: dict) -> list[dict]:
    """The chat's messages as mlx_lm.server hands them to the chat template: every key kept
    (``tool_call_id``, ``name``, ...), content text, tool calls' arguments read."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("the request needs messages: a non-empty list", "missing_field")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string role")
        message = {**message, "content": _message_content(message.get("content"), i)}
        if message.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(message["tool_calls"], i)
        checked.append(message)
    return checked


def _logit_bias(body: dict) -> dict[int, float]:
    """``logit_bias``: token ids (as strings) to biases in [-100, 100]; the ids are measured
    against the vocabulary where it is known (the app)."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise _bad("logit_bias must be an object of token ids to numbers", "invalid_type")
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise _bad(f"{key!r:.40} is no token id", "invalid_type")
        out[int(key)] = _number(bias, key, 0.0, -100.0, 100.0)
    return out


def _sampling(body: dict, defaults: Defaults) -> dict[str, Any]:
    """The ``Sampler`` keywords of the request's knobs."""
    sampling = {
        "temperature": _number(body, "temperature", defaults.temperature, 0.0, 100.0),
        "top_p": _number(body, "top_p", defaults.top_p, 0.0, 1.0),
    }
    if sampling["top_p"] == 0.0:
        raise _bad("top_p must be in (0, 1], got 0")
    server = {"top_k": defaults.top_k, "min_p": defaults.min_p}
    for name, default, low, high in _INT_KNOBS:
        sampling[name] = _integer(body, name, server.get(name, default), low, high)
    for name, default, low, high in _FLOAT_KNOBS:
        sampling[name] = _number(body, name, server.get(name, default), low, high)
    try:
        sampling["logit_bias"] = _logit_bias(body)
    except APIError as error:
        # _number names the token id: the message names the field first.
        raise _bad(f"logit_bias: {error.message}", error.code) from None
    return sampling


def _logprobs(body: dict, kind: str) -> Optional[int]:
    """How many alternatives each reported token comes with; ``None``: no logprobs."""
    if kind == "chat":
        top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if not _boolean(body, "logprobs"):
            if top:
                raise _bad("top_logprobs needs logprobs: true")
            return None
        return top or 0
    # The legacy completions field: the number of alternatives (OpenAI's bound is 5).
    return _integer(body, "logprobs", None, 0, MAX_LOGPROBS)


def parse_request(body: Any, kind: str, defaults: Defaults) -> CompletionRequest:
    """A ``/v1/completions`` (``kind="text"``) or ``/v1/chat/completions`` (``"chat"``) body,
    checked: ``APIError`` 400 naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "invalid_type")
    check_strings(body)
    for name, asks_nothing in REFUSED.items():
        if name in body and not asks_nothing(body[name]):
            raise _bad(f"{name} is not served by this server (value {_shown(body[name])})",
                       "unsupported_field")
    model = body.get("model")
    request = CompletionRequest(kind=kind, model=_text(model or DEFAULT_MODEL, "model"))
    if kind == "text":
        if "prompt" not in body:
            raise _bad("the request needs a prompt", "missing_field")
        request.prompts = _prompts(body["prompt"])
        request.echo = _boolean(body, "echo")
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, [], "none", "auto"):
                raise _bad(f"{name} is served by /v1/chat/completions only", "unsupported_field")
    else:
        request.messages = _messages(body)
        if _boolean(body, "echo"):
            raise _bad("echo is served by /v1/completions only", "unsupported_field")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs must be an object", "invalid_type")
        request.chat_template_kwargs = kwargs
        request.tools = parse_tools(body)
    request.constraint = parse_constraint(body, request.tools)
    # max_completion_tokens is the newer name; 0 serves a completion's echoed prompt alone.
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else (
        "max_tokens")
    least = 0 if request.echo else 1
    request.max_tokens = _integer(body, name, defaults.max_tokens, least, 2**63)
    request.n = _integer(body, "n", 1, 1, MAX_CHOICES)
    if len(request.prompts) * request.n > MAX_CHOICES:
        raise _bad(f"n: {len(request.prompts)} prompts x n={request.n} exceed the most "
                   f"choices a request may ask for, {MAX_CHOICES}")
    request.sampling = _sampling(body, defaults)
    seed = _integer(body, "seed", None, _SEED_RANGE[0], _SEED_RANGE[1] - 1)
    # Clients send -1 for "any seed": every seed in range maps into the sampler's 64 bits.
    request.seed = None if seed is None else seed % 2**64
    request.logprobs = _logprobs(body, kind)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop must be a string or a list of non-empty strings", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad(f"stop holds {len(stop)} strings, more than {MAX_STOP_STRINGS}")
    request.stop = stop
    request.stream = _boolean(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "invalid_type")
    request.include_usage = _boolean(options, "include_usage")
    return request
