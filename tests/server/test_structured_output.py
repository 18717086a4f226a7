"""Structured output on the native server (a process on 127.0.0.1, always stopped), on a
random-weight model with a byte-level tokenizer, at temperature 1 over many seeds: every
answer that finishes "stop" matches what was asked for (a JSON schema, any JSON object, a
regex, a choice, a Lark grammar; a named or required ``tool_choice``'s calls validate against
their function's schema; after an open thinking section, the answer); a streamed answer
equals the whole one of the same seed; a schema or
grammar that does not compile is a 400 naming its field; and docs/server.md's examples with
the ``openai`` client."""

import json
import re
import typing

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("starlette")
pytest.importorskip("llguidance")
pydantic = pytest.importorskip("pydantic")

from mlx_batched_decode.tools.local_server import running_server  # noqa: E402
from mlx_batched_decode.tools.model_folder import BYTE_VOCAB, save_byte_model_folder  # noqa
from tests.server.test_native_server import (  # noqa: E402
    NATIVE,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    events,
    post,
)
from tests.support.mlx_lm_models import SMALL_LLAMA  # noqa: E402

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
# Seeds per request: n choices, each its own stream of the seed.
N = 8
# A random model writes long strings and much whitespace: room for both, and bounded strings.
MAX_TOKENS = 320


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=8)
    degrees: int = pydantic.Field(ge=-60, le=60)
    sunny: bool


class Zone(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    zone: typing.Literal["UTC", "CET"]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
                                      "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {"name": "get_time",
                                      "parameters": Zone.model_json_schema()}},
]
MODELS = {"get_weather": Weather, "get_time": Zone}
MESSAGES = [{"role": "user", "content": "Answer."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_byte_model_folder(dict(SMALL_LLAMA, vocab_size=BYTE_VOCAB + 6),
                                    tmp_path_factory.mktemp("byte"), seed=3)
    log = tmp_path_factory.mktemp("log") / "structured.log"
    args = ["--model", str(folder), "--log-level", "WARNING", "--max-batch-size", "16"]
    with running_server([*NATIVE, *args], log, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S) as (port, _):
        yield port


def answers(port, body, path=CHAT, seeds=(1, 2)):
    """Every choice of ``body`` at temperature 1, ``N`` per seed: (finish_reason, message or
    text) each; at least one finished "stop"."""
    out = []
    for seed in seeds:
        request = {"max_tokens": MAX_TOKENS, **body, "temperature": 1.0, "seed": seed, "n": N}
        status, _, raw = post(port, path, request)
        assert status == 200, raw
        for choice in json.loads(raw)["choices"]:
            out.append((choice["finish_reason"],
                        choice["message"] if path == CHAT else choice["text"]))
    assert any(reason != "length" for reason, _ in out), out
    return [(reason, answer) for reason, answer in out if reason != "length"]


def test_json_schema_and_json_object_answers_validate(server):
    schema = {"type": "json_schema",
              "json_schema": {"name": "weather", "schema": Weather.model_json_schema(),
                              "strict": True}}
    for reason, message in answers(server, {"messages": MESSAGES, "response_format": schema}):
        assert reason == "stop"
        Weather.model_validate_json(message["content"], strict=True)
    for reason, message in answers(server, {"messages": MESSAGES,
                                            "response_format": {"type": "json_object"}}):
        assert reason == "stop" and isinstance(json.loads(message["content"]), dict)


def test_regex_choice_and_grammar_through_structured_outputs(server):
    pattern = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
    for reason, text in answers(server, {"prompt": "mail:",
                                         "structured_outputs": {"regex": pattern}}, TEXT):
        assert reason == "stop" and re.fullmatch(pattern, text), text
    choices = ["red", "green", "blue"]
    for reason, message in answers(server, {"messages": MESSAGES,
                                            "structured_outputs": {"choice": choices}}):
        assert reason == "stop" and message["content"] in choices
    grammar = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    for reason, text in answers(server, {"prompt": "tuple:", "guided_grammar": grammar}, TEXT):
        assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", text), text


def test_named_and_required_tool_choice_calls_validate(server):
    named = {"type": "function", "function": {"name": "get_time"}}
    for reason, message in answers(server, {"messages": MESSAGES, "tools": TOOLS,
                                            "tool_choice": named}):
        assert reason == "stop" and message["content"] is None
        (call,) = message["tool_calls"]
        assert call["id"].startswith("call_") and call["function"]["name"] == "get_time"
        Zone.model_validate_json(call["function"]["arguments"], strict=True)
    for reason, message in answers(server, {"messages": MESSAGES, "tools": TOOLS,
                                            "tool_choice": "required"}):
        assert reason == "tool_calls" and message["tool_calls"]
        for call in message["tool_calls"]:
            model = MODELS[call["function"]["name"]]
            model.model_validate_json(call["function"]["arguments"], strict=True)


def joined(chunks):
    """A stream's choice 0 put together: its text, its calls (ids left out), finish_reason."""
    text, calls, reason = "", [], None
    for chunk in chunks:
        if chunk == "[DONE]" or not chunk["choices"]:
            continue
        choice = chunk["choices"][0]
        text += choice["delta"].get("content", "")
        calls += [c["function"] for c in choice["delta"].get("tool_calls", [])]
        reason = choice["finish_reason"] or reason
    return text or None, calls, reason


def test_streamed_answers_equal_whole_ones(server):
    requests = [
        {"response_format": {"type": "json_object"}},
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    ]
    for extra in requests:
        for seed in range(4):
            body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 1.0,
                    "seed": seed, **extra}
            whole = json.loads(post(server, CHAT, body)[2])["choices"][0]
            streamed = joined(events(post(server, CHAT, {**body, "stream": True})[2]))
            message = whole["message"]
            calls = [c["function"] for c in message.get("tool_calls", [])]
            assert streamed == (message["content"], calls, whole["finish_reason"])


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
])
def test_what_does_not_compile_is_a_400_naming_its_field(server, body, field):
    status, _, raw = post(server, CHAT, {"messages": MESSAGES, **body})
    assert status == 400, raw
    assert json.loads(raw)["error"]["message"].startswith(field + ":"), raw


def test_the_docs_examples_with_the_openai_client(server):
    """docs/server.md's forced call, pydantic schema and regex examples."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="none", max_retries=0,
                    timeout=60)
    forced = client.chat.completions.create(
        model="default_model", messages=MESSAGES, tools=TOOLS[:1], temperature=1.0, seed=5,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
    )
    Weather.model_validate_json(forced.choices[0].message.tool_calls[0].function.arguments)

    class Reading(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=8)
        degrees: int

    parsed = [client.beta.chat.completions.parse(
        model="default_model", messages=MESSAGES, response_format=Reading,
        max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
    ).choices[0] for seed in range(4)]
    assert any(choice.finish_reason == "stop" for choice in parsed)
    for choice in parsed:
        if choice.finish_reason == "stop":
            assert isinstance(choice.message.parsed, Reading)

    pattern = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
    mail = client.completions.create(
        model="default_model", prompt="An address:", max_tokens=40, temperature=1.0, seed=2,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, mail.choices[0].text)


def test_a_constraint_starts_after_an_open_thinking_section(tmp_path):
    """A template that leaves ``<think>`` open: the reasoning is free, the answer after
    ``</think>`` (biased to come soon) is the JSON object asked for."""
    from mlx_batched_decode.tools.model_folder import BYTE_THINK_END_ID, CHAT_TEMPLATE

    folder = save_byte_model_folder(dict(SMALL_LLAMA, vocab_size=BYTE_VOCAB + 6),
                                    tmp_path / "model", seed=3)
    template = CHAT_TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|><think>{% endif %}")
    args = ["--model", str(folder), "--log-level", "WARNING", "--chat-template", template]
    with running_server([*NATIVE, *args], tmp_path / "think.log", STARTUP_TIMEOUT_S,
                        STOP_TIMEOUT_S) as (port, _):
        body = {"messages": MESSAGES, "response_format": {"type": "json_object"},
                "logit_bias": {str(BYTE_THINK_END_ID): 4.0}}
        done = answers(port, body)
    for reason, message in done:
        assert reason == "stop" and isinstance(json.loads(message["content"]), dict)
    assert any(message.get("reasoning") for _, message in done)
