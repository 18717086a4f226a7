"""The server's request checks and response bodies, without a server: every bad field is an
``APIError`` 400 naming it, and the bodies have mlx_lm.server's keys in its order."""

import pytest

pytest.importorskip("starlette")

from mlx_batched_decode.server.protocol import (  # noqa: E402
    APIError,
    Defaults,
    ResponseHeader,
    parse_request,
    response_body,
    usage_body,
    usage_counts,
)

CHAT = {"messages": [{"role": "user", "content": "w9"}]}
TEXT = {"prompt": "w9 w10"}


@pytest.mark.parametrize(
    "kind, body, field",
    [
        ("text", [1, 2], "JSON object"),
        ("text", {}, "prompt"),
        ("text", {"prompt": ""}, "prompt is empty"),
        ("text", {"prompt": 7}, "prompt must be a string"),
        ("chat", {}, "messages"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": ["hi"]}, "messages\\[0\\]"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "text"),
        ("chat", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
        ("text", {**TEXT, "max_tokens": 0}, "max_tokens"),
        ("text", {**TEXT, "max_tokens": -5}, "max_tokens"),
        ("text", {**TEXT, "max_tokens": 2.5}, "max_tokens"),
        ("text", {**TEXT, "max_tokens": True}, "max_tokens"),
        ("text", {**TEXT, "max_tokens": "9"}, "max_tokens"),
        ("text", {**TEXT, "temperature": "hot"}, "temperature"),
        ("text", {**TEXT, "temperature": -1}, "temperature"),
        ("text", {**TEXT, "temperature": float("nan")}, "temperature"),
        ("text", {**TEXT, "top_p": 0}, "top_p"),
        ("text", {**TEXT, "top_p": 1.5}, "top_p"),
        ("text", {**TEXT, "seed": 1.5}, "seed"),
        ("text", {**TEXT, "stop": 5}, "stop"),
        ("text", {**TEXT, "stop": ["ok", ""]}, "stop"),
        ("text", {**TEXT, "stream": "yes"}, "stream"),
        ("text", {**TEXT, "stream_options": {"include_usage": 1}}, "stream_options"),
        ("text", {**TEXT, "model": 3}, "model"),
        ("text", {**TEXT, "logprobs": True}, "logprobs"),
        ("chat", {**CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ],
)
def test_bad_fields_are_400_naming_them(kind, body, field):
    with pytest.raises(APIError, match=field) as raised:
        parse_request(body, kind, Defaults())
    assert raised.value.status == 400
    error = raised.value.body()["error"]
    assert set(error) == {"message", "type", "code"} and error["type"] == "invalid_request_error"


def test_defaults_and_accepted_forms():
    request = parse_request({**TEXT, "stop": "w3"}, "text", Defaults(7, 0.5, 0.9))
    assert (request.max_tokens, request.temperature, request.top_p) == (7, 0.5, 0.9)
    assert request.stop == ["w3"] and request.model == "default_model" and not request.stream
    chat = parse_request(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": None}],
            "max_completion_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": 4,
        },
        "chat",
        Defaults(),
    )
    assert chat.messages == [{"role": "user", "content": "ab"},
                             {"role": "assistant", "content": ""}]
    assert (chat.max_tokens, chat.stream, chat.include_usage, chat.seed) == (3, True, True, 4)


def test_bodies_have_mlx_lm_servers_keys_in_order():
    header = ResponseHeader("cmpl-1", "fp", "text_completion", "default_model", 5)
    usage = usage_counts(4, 2, 1)
    assert usage == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                     "prompt_tokens_details": {"cached_tokens": 1}}
    body = response_body(header, False, False, "w5 w6", "length", usage=usage)
    assert list(body) == ["id", "system_fingerprint", "object", "model", "created", "choices",
                          "usage"]
    assert body["choices"] == [{"index": 0, "finish_reason": "length", "text": "w5 w6"}]
    chat = ResponseHeader("chatcmpl-1", "fp", "chat.completion", "m", 5)
    message = response_body(chat, True, False, "", "stop", usage=usage)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None}
    delta = response_body(chat, True, True, "", None)["choices"][0]["delta"]
    assert delta == {"role": "assistant"}
    assert usage_body(chat, usage)["object"] == "chat.completion"
