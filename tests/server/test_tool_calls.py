"""Tool calls on the native server against mlx_lm.server's, on a model whose greedy answers
are chosen texts (``tests/support/chain_model.py``): one call, several calls after some text,
a plain answer to a tool's result in the conversation; whole and streamed. Both servers run
the same requests; their bodies agree but for ids (tool calls' included), times and
fingerprints, and ours name their calls ``call_...``."""

import json
import sys

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("starlette")

from mlx_batched_decode.tools.local_server import running_server  # noqa: E402
from tests.server.test_native_server import (  # noqa: E402
    NATIVE,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    events,
    post,
    stable,
)
from tests.support.chain_model import save_chain_model_folder  # noqa: E402

CHAT = "/v1/chat/completions"
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ANSWERS = {
    "weather": f"<tool_call>{WEATHER}</tool_call>",
    "both": 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}'
            "</tool_call>",
    "report": "It is sunny in Paris.",
    # docs/server.md's example: the question, then the tool's result.
    "Paris?": f"<tool_call>{WEATHER}</tool_call>",
    "Paris": "Sunny, as the tool says.",
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object",
                                           "properties": {"zone": {"type": "string"}}}}},
]
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "report"},
]
REQUESTS = [
    {"messages": [{"role": "user", "content": "weather"}], "tools": TOOLS},
    {"messages": [{"role": "user", "content": "both"}], "tools": TOOLS},
    {"messages": HISTORY, "tools": TOOLS},
    {"messages": [{"role": "user", "content": "weather"}], "tools": TOOLS, "max_tokens": 5},
]


@pytest.fixture(scope="module")
def chain_dir(tmp_path_factory):
    return save_chain_model_folder(ANSWERS, tmp_path_factory.mktemp("chain"))


def without_call_ids(body):
    """``body`` without its tool calls' ids and cached-token count (mlx_lm.server's prompt
    cache reuses the prompts' shared start; ours is off by default)."""
    body.get("usage", {}).pop("prompt_tokens_details", None)
    for choice in body.get("choices", []):
        for call in (choice.get("message") or choice.get("delta") or {}).get("tool_calls", []):
            del call["id"]
    return body


def responses(port):
    out = []
    for request in REQUESTS:
        for stream in (False, True):
            status, _, raw = post(port, CHAT, {**request, "stream": stream})
            assert status == 200, raw
            bodies = events(raw)[:-1] if stream else [stable(json.loads(raw))]
            out.append([without_call_ids(body) for body in bodies])
    return out


def test_tool_calls_equal_mlx_lm_servers(chain_dir, tmp_path):
    args = ["--model", str(chain_dir), "--log-level", "WARNING"]
    results = {}
    for name, command in (("mlx-lm", [sys.executable, "-m", "mlx_lm", "server"]),
                          ("native", NATIVE)):
        with running_server([*command, *args], tmp_path / f"{name}.log", STARTUP_TIMEOUT_S,
                            STOP_TIMEOUT_S) as (port, _):
            results[name] = responses(port)
            if name == "native":
                status, _, raw = post(port, CHAT, REQUESTS[0])
                ids = [c["id"] for c in json.loads(raw)["choices"][0]["message"]["tool_calls"]]
                assert all(i.startswith("call_") for i in ids)
    assert results["native"] == results["mlx-lm"]

    one, _, two, _, history, _, cut, _ = [r[0] for r in results["native"]]
    message = one["choices"][0]["message"]
    assert one["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": "Paris"}]
    message = two["choices"][0]["message"]
    assert message["content"] == "Let me check."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert history["choices"][0]["message"] == {"role": "assistant",
                                                "content": "It is sunny in Paris."}
    # The conversation reached the template: its tool call and result are in the prompt.
    assert history["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"] + 8
    # Cut short inside its call: no call, and "length".
    assert cut["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in cut["choices"][0]["message"]
    # A stream's calls come whole, with their index.
    streamed = [d["choices"][0]["delta"] for d in results["native"][3] if d["choices"]]
    calls = [c for d in streamed for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"),
                                                                   (1, "get_time")]


def test_tool_choice_none_offers_and_parses_no_tools(chain_dir, tmp_path):
    args = ["--model", str(chain_dir), "--log-level", "WARNING"]
    with running_server([*NATIVE, *args], tmp_path / "none.log", STARTUP_TIMEOUT_S,
                        STOP_TIMEOUT_S) as (port, _):
        request = {**REQUESTS[0], "tool_choice": "none"}
        body = json.loads(post(port, CHAT, request)[2])
        offered = json.loads(post(port, CHAT, REQUESTS[0])[2])
        # The call's text is the answer; no tools reached the template.
        assert body["choices"][0]["message"] == {"role": "assistant", "content": WEATHER}
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["prompt_tokens"] < offered["usage"]["prompt_tokens"]
        for bad, field in (
            ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "tool_choice"),
            ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0]"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
             "tools[0].function.parameters"),
            ({"tools": TOOLS[:1], "messages": [{"role": "assistant", "tool_calls": [
                {"function": {"name": "f", "arguments": "{"}}]}]},
             "messages[0].tool_calls[0].function.arguments"),
        ):
            status, _, raw = post(port, CHAT, {**REQUESTS[0], **bad})
            assert status == 400, raw
            assert json.loads(raw)["error"]["message"].startswith(field), raw


def test_the_docs_tool_example_with_the_openai_client(chain_dir, tmp_path):
    """docs/server.md's tool example: the call, its result sent back, the answer."""
    from openai import OpenAI

    args = ["--model", str(chain_dir), "--log-level", "WARNING"]
    with running_server([*NATIVE, *args], tmp_path / "docs.log", STARTUP_TIMEOUT_S,
                        STOP_TIMEOUT_S) as (port, _):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                        timeout=60)
        tools = TOOLS[:1]
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        answer = client.chat.completions.create(model="default_model", messages=messages,
                                                tools=tools)
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls"
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            city = json.loads(call.function.arguments)["city"]
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": f"sunny in {city}"})
        answer = client.chat.completions.create(model="default_model", messages=messages,
                                                tools=tools)
        assert answer.choices[0].message.content == "Sunny, as the tool says."
