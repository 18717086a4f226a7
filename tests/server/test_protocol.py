"""The server's request checks and response bodies, without a server: every bad field is an
``APIError`` 400 naming it, every field served reaches the request, and the bodies have
mlx_lm.server's keys in its order (OpenAI's shapes for logprobs and several choices)."""

import json

import pytest

pytest.importorskip("starlette")

from mlx_batched_decode.server.fields import REFUSED, parse_request  # noqa: E402
from mlx_batched_decode.server.protocol import APIError, Defaults  # noqa: E402
from mlx_batched_decode.server.responses import (  # noqa: E402
    ChoiceBody,
    LogprobRow,
    ResponseHeader,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
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
        ("text", {"prompt": 7}, "prompt must be"),
        ("text", {"prompt": []}, "prompt is empty"),
        ("text", {"prompt": [1, -2]}, "prompt must hold token ids"),
        ("text", {"prompt": [1, True]}, "prompt"),
        ("text", {"prompt": [[1], []]}, "prompt\\[1\\] is empty"),
        ("text", {"prompt": ["a", 3]}, "prompt\\[1\\]"),
        ("text", {"prompt": ["a", [1, 2.5]]}, "prompt\\[1\\]"),
        ("chat", {}, "messages"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": ["hi"]}, "messages\\[0\\]"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "text"),
        ("chat", {**CHAT, "tools": [{"type": "function"}]}, "tools\\[0\\].function"),
        ("chat", {**CHAT, "tools": {"f": 1}}, "tools"),
        ("chat", {**CHAT, "tools": [{"function": {"name": "f", "parameters": []}}]},
         "tools\\[0\\].function.parameters"),
        ("chat", {**CHAT, "tools": [{"function": {"name": "f"}}] * 2}, "tools"),
        ("chat", {**CHAT, "tool_choice": "required"}, "tool_choice"),
        ("chat", {**CHAT, "tool_choice": "any"}, "tool_choice"),
        ("chat", {**CHAT, "tools": [{"function": {"name": "f"}}],
                  "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        ("text", {**TEXT, "tools": [{"function": {"name": "f"}}]}, "tools"),
        ("chat", {**CHAT, "messages": [{"role": "assistant", "tool_calls": {}}]},
         "messages\\[0\\].tool_calls"),
        ("chat", {**CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
        ("chat", {**CHAT, "response_format": {"type": "json_schema"}},
         "response_format.json_schema"),
        ("chat", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": 3}}}, "response_format.json_schema.schema"),
        ("chat", {**CHAT, "guided_json": "{"}, "guided_json"),
        ("chat", {**CHAT, "guided_choice": []}, "guided_choice"),
        ("text", {**TEXT, "structured_outputs": {"regex": "a", "choice": ["b"]}},
         "structured_outputs"),
        ("text", {**TEXT, "structured_outputs": {"structural_tag": "a"}},
         "structured_outputs.structural_tag"),
        ("text", {**TEXT, "structured_outputs": {"grammar": 3}}, "structured_outputs.grammar"),
        ("chat", {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
         "response_format and guided_regex"),
        ("chat", {**CHAT, "tools": [{"function": {"name": "f"}}], "tool_choice": "required",
                  "response_format": {"type": "json_object"}}, "response_format and tool_choice"),
        ("chat", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
        ("text", {**TEXT, "suffix": "end"}, "suffix"),
        ("text", {**TEXT, "best_of": 2}, "best_of"),
        ("text", {**TEXT, "best_of": True}, "best_of"),
        ("chat", {**CHAT, "echo": True}, "echo"),
        ("text", {**TEXT, "max_tokens": 0}, "max_tokens"),
        ("text", {**TEXT, "max_tokens": -5}, "max_tokens"),
        ("text", {**TEXT, "max_tokens": 2.5}, "max_tokens"),
        ("text", {**TEXT, "max_tokens": True}, "max_tokens"),
        ("text", {**TEXT, "max_tokens": "9"}, "max_tokens"),
        ("text", {**TEXT, "max_tokens": 2**70}, "max_tokens"),
        ("chat", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("text", {**TEXT, "temperature": "hot"}, "temperature"),
        ("text", {**TEXT, "temperature": -1}, "temperature"),
        ("text", {**TEXT, "temperature": float("nan")}, "temperature"),
        ("text", {**TEXT, "temperature": float("inf")}, "temperature"),
        ("text", {**TEXT, "temperature": 10**400}, "temperature"),
        ("text", {**TEXT, "top_p": 0}, "top_p"),
        ("text", {**TEXT, "top_p": 1.5}, "top_p"),
        ("text", {**TEXT, "top_k": -1}, "top_k"),
        ("text", {**TEXT, "top_k": 1.0}, "top_k"),
        ("text", {**TEXT, "min_p": 2}, "min_p"),
        ("text", {**TEXT, "repetition_penalty": -1}, "repetition_penalty"),
        ("text", {**TEXT, "repetition_context_size": -1}, "repetition_context_size"),
        ("text", {**TEXT, "presence_penalty": "x"}, "presence_penalty"),
        ("text", {**TEXT, "frequency_penalty": 1e9}, "frequency_penalty"),
        ("text", {**TEXT, "frequency_context_size": False}, "frequency_context_size"),
        ("text", {**TEXT, "xtc_probability": 1.5}, "xtc_probability"),
        ("text", {**TEXT, "xtc_threshold": 0.9}, "xtc_threshold"),
        ("text", {**TEXT, "logit_bias": [1]}, "logit_bias"),
        ("text", {**TEXT, "logit_bias": {"a": 1}}, "logit_bias"),
        ("text", {**TEXT, "logit_bias": {"-1": 1}}, "logit_bias"),
        ("text", {**TEXT, "logit_bias": {"1": 101}}, "logit_bias"),
        ("text", {**TEXT, "logit_bias": {"1": "up"}}, "logit_bias"),
        ("text", {**TEXT, "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ("text", {**TEXT, "seed": 1.5}, "seed"),
        ("text", {**TEXT, "seed": 2**64}, "seed"),
        ("text", {**TEXT, "seed": -(2**63) - 1}, "seed"),
        ("text", {**TEXT, "seed": 2**70}, "seed"),
        ("text", {**TEXT, "seed": True}, "seed"),
        ("text", {**TEXT, "n": 0}, "n"),
        ("text", {**TEXT, "n": 17}, "n"),
        ("text", {"prompt": ["a", "b", "c"], "n": 6}, "n"),
        ("text", {**TEXT, "logprobs": True}, "logprobs"),
        ("text", {**TEXT, "logprobs": 21}, "logprobs"),
        ("text", {**TEXT, "echo": 1}, "echo"),
        ("chat", {**CHAT, "logprobs": 1}, "logprobs"),
        ("chat", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
        ("chat", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("text", {**TEXT, "stop": 5}, "stop"),
        ("text", {**TEXT, "stop": ["ok", ""]}, "stop"),
        ("text", {**TEXT, "stop": ["s"] * 65}, "stop"),
        ("text", {**TEXT, "stream": "yes"}, "stream"),
        ("text", {**TEXT, "stream_options": {"include_usage": 1}}, "include_usage"),
        ("text", {**TEXT, "stream_options": [1]}, "stream_options"),
        ("text", {**TEXT, "model": 3}, "model"),
        ("chat", {**CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ("text", {"prompt": "a\ud800b"}, "prompt holds a lone surrogate"),
        ("text", {**TEXT, "stop": ["ok", "\udfff"]}, "stop\\[1\\]"),
        ("chat", {"messages": [{"role": "user", "content": "\ud800"}]},
         "messages\\[0\\].content"),
        ("text", {**TEXT, "user": {"\ud800": 1}}, "user \\(a key\\)"),
    ],
)
def test_bad_fields_are_400_naming_them(kind, body, field):
    with pytest.raises(APIError, match=field) as raised:
        parse_request(body, kind, Defaults())
    assert raised.value.status == 400
    error = raised.value.body()["error"]
    assert set(error) == {"message", "type", "code"} and error["type"] == "invalid_request_error"
    json.dumps(error)  # the message itself is JSON-safe


def test_nesting_is_refused_without_recursion():
    body = dict(TEXT)
    nested = body["metadata"] = []
    for _ in range(20_000):
        nested.append([])
        nested = nested[0]
    with pytest.raises(APIError, match="metadata.*nests deeper") as raised:
        parse_request(body, "text", Defaults())
    assert raised.value.status == 400


def test_refused_fields_asking_for_nothing_are_accepted():
    nothing = {"functions": None, "function_call": "auto", "parallel_tool_calls": True,
               "suffix": "", "best_of": 1, "modalities": ["text"], "min_tokens": 0,
               "ignore_eos": False, "draft_model": "default_model"}
    assert set(nothing) | {"prediction", "audio", "web_search_options", "reasoning_effort",
                           "adapters"} == set(REFUSED)
    harmless = {"user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
                "prediction": None, "not_an_openai_field": [1, {"x": 2}]}
    parse_request({**TEXT, **nothing, **harmless}, "text", Defaults())


def test_defaults_and_accepted_forms():
    request = parse_request({**TEXT, "stop": "w3"}, "text", Defaults(7, 0.5, 0.9, 40, 0.05))
    assert (request.max_tokens, request.n, request.logprobs, request.echo) == (7, 1, None, False)
    assert request.sampling == {
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 0.0, "repetition_context_size": 20, "presence_penalty": 0.0,
        "presence_context_size": 20, "frequency_penalty": 0.0, "frequency_context_size": 20,
        "xtc_probability": 0.0, "xtc_threshold": 0.1, "logit_bias": {},
    }
    assert request.stop == ["w3"] and request.model == "default_model" and not request.stream
    assert request.prompts == ["w9 w10"]
    chat = parse_request(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": None}],
            "max_completion_tokens": 3, "max_tokens": 99,
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": 4,
            "logprobs": True,
            "top_logprobs": 5,
            "n": 3,
            "top_k": 7, "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": -0.5,
            "frequency_penalty": 2, "logit_bias": {"5": -100, "7": 2.5}, "xtc_probability": 0.5,
            "xtc_threshold": 0.2, "repetition_context_size": 0,
        },
        "chat",
        Defaults(),
    )
    assert chat.messages == [{"role": "user", "content": "ab"},
                             {"role": "assistant", "content": ""}]
    assert (chat.max_tokens, chat.stream, chat.include_usage, chat.seed) == (3, True, True, 4)
    assert (chat.n, chat.logprobs) == (3, 5)
    assert chat.sampling["logit_bias"] == {5: -100.0, 7: 2.5}
    assert (chat.sampling["top_k"], chat.sampling["frequency_penalty"]) == (7, 2.0)
    assert parse_request({**CHAT, "logprobs": True}, "chat", Defaults()).logprobs == 0
    assert parse_request({**CHAT, "logprobs": False, "top_logprobs": 0}, "chat",
                         Defaults()).logprobs is None


@pytest.mark.parametrize("seed, mapped", [(-1, 2**64 - 1), (0, 0), (2**64 - 1, 2**64 - 1),
                                          (-(2**63), 2**63), (None, None)])
def test_every_seed_in_range_maps_into_64_bits(seed, mapped):
    assert parse_request({**TEXT, "seed": seed}, "text", Defaults()).seed == mapped


def test_prompt_forms_and_echo():
    def prompts(prompt):
        return parse_request({"prompt": prompt}, "text", Defaults()).prompts

    assert prompts([5, 6]) == [[5, 6]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[5], [6, 7]]) == [[5], [6, 7]]
    assert prompts(["a", [6]]) == ["a", [6]]
    # lm-evaluation-harness scores a prompt: its tokens' logprobs, nothing generated.
    request = parse_request({"prompt": "a b", "echo": True, "max_tokens": 0, "logprobs": 1},
                            "text", Defaults())
    assert (request.echo, request.max_tokens, request.logprobs) == (True, 0, 1)


class Texts(TokenTexts):
    """Token 5 is "é" (two UTF-8 bytes), the others "w<id>"."""

    def __init__(self):
        super().__init__(type("T", (), {"decode": staticmethod(
            lambda ids: "é" if ids == [5] else f" w{ids[0]}")})())


def test_logprob_shapes_are_openais():
    texts = Texts()
    rows = [LogprobRow(5, -0.25, [(5, -0.25), (7, -2.0)]),
            LogprobRow(7, float("-inf"), [])]
    assert chat_logprobs(rows, texts) == {"content": [
        {"token": "é", "logprob": -0.25, "bytes": [195, 169],
         "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [195, 169]},
                          {"token": " w7", "logprob": -2.0, "bytes": [32, 119, 55]}]},
        {"token": " w7", "logprob": -9999.0, "bytes": [32, 119, 55], "top_logprobs": []},
    ]}
    echo = [LogprobRow(9, None, None), *rows]
    assert completion_logprobs(echo, texts, [3, 6, 7]) == {
        "tokens": [" w9", "é", " w7"],
        "token_logprobs": [None, -0.25, -9999.0],
        "top_logprobs": [None, {"é": -0.25, " w7": -2.0}, {}],
        "text_offset": [3, 6, 7],
    }


def test_bodies_have_mlx_lm_servers_keys_in_order():
    header = ResponseHeader("cmpl-1", "fp", "text_completion", "default_model", 5)
    usage = usage_counts(4, 2, 1)
    assert usage == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                     "prompt_tokens_details": {"cached_tokens": 1}}
    body = response_body(header, False, False, [ChoiceBody(0, "w5 w6", "length")], usage)
    assert list(body) == ["id", "system_fingerprint", "object", "model", "created", "choices",
                          "usage"]
    assert body["choices"] == [{"index": 0, "finish_reason": "length", "text": "w5 w6"}]
    chat = ResponseHeader("chatcmpl-1", "fp", "chat.completion", "m", 5)
    two = [ChoiceBody(0, "", "stop"), ChoiceBody(1, "a", "length", logprobs={"content": []})]
    choices = response_body(chat, True, False, two, usage)["choices"]
    assert choices == [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": None}},
        {"index": 1, "finish_reason": "length", "message": {"role": "assistant", "content": "a"},
         "logprobs": {"content": []}},
    ]
    delta = response_body(chat, True, True, [ChoiceBody(0, "")])["choices"][0]["delta"]
    assert delta == {"role": "assistant"}
    assert usage_body(chat, usage)["object"] == "chat.completion"


def test_constraints_read_into_one_grammar():
    from mlx_batched_decode.decoding.grammar import GrammarSpec

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}},
             {"type": "function", "function": {"name": "g"}}]
    cases = [
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object"),
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                     "schema": schema}}},
         GrammarSpec("json_schema", json.dumps(schema)), "response_format"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, GrammarSpec("regex", "[a-z]+"),
         "structured_outputs"),
        ({"structured_outputs": {"choice": ["x", "y"], "regex": None}},
         GrammarSpec("choice", '["x", "y"]'), "structured_outputs"),
        ({"guided_grammar": 'start: "a"'}, GrammarSpec("lark", 'start: "a"'), "guided_grammar"),
        ({"guided_json": json.dumps(schema)}, GrammarSpec("json_schema", json.dumps(schema)),
         "guided_json"),
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}},
         GrammarSpec("json_schema", json.dumps(schema)), "tools[0].function.parameters"),
    ]
    for fields, spec, field in cases:
        constraint = parse_request({**CHAT, **fields}, "chat", Defaults()).constraint
        assert (constraint.spec, constraint.field) == (spec, field)
    required = parse_request({**CHAT, "tools": tools, "tool_choice": "required"}, "chat",
                             Defaults())
    array = json.loads(required.constraint.spec.source)
    assert array["type"] == "array" and array["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in array["items"]["anyOf"]] == [["f"], ["g"]]
    assert required.tools.forced and not required.tools.parsed
    for choice in ("none", "auto"):
        request = parse_request({**CHAT, "tools": tools, "tool_choice": choice}, "chat",
                                Defaults())
        assert request.constraint is None
        assert request.tools.tools == (None if choice == "none" else tools)
