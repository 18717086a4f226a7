"""Every request field through HTTP, on the native server (a process on 127.0.0.1, always
stopped): several choices and prompts, logprobs (chat and legacy, echoed prompts included),
seeds of any 64-bit value, the endpoints and CORS, keep-alive comments, a step that fails, a
model named by a Hugging Face repo id from the local cache, a fuzz of a few hundred bodies
that no answer of which is a 5xx; logprobs against a direct forward pass of the served model,
truncations to one token and seeded requests among others, the docs' examples with the
``openai`` client, and a slow tokenizer beside an open stream."""

import http.client
import json
import random
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from mlx_batched_decode.tools.local_server import running_server  # noqa: E402
from tests.support.mlx_lm_models import direct_logprobs  # noqa: E402
from tests.server.test_native_server import (  # noqa: E402, F401
    NATIVE,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    VOCAB,
    events,
    get,
    model_dir,
    post,
    words,
)

TEXT, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "fields.log"
    args = ["--model", str(model_dir), "--log-level", "WARNING", "--max-batch-size", "16",
            "--max-context-length", "2048"]
    with running_server([*NATIVE, *args], log, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S) as (port, _):
        yield port


def ok(port, path, body):
    status, headers, raw = post(port, path, body)
    assert status == 200, raw
    return headers, (events(raw) if body.get("stream") else json.loads(raw))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from mlx_lm.utils import load

    return load(str(model_dir))[1]


def test_choices_and_prompt_forms(server, tokenizer):
    prompt = words(1, 6)
    _, one = ok(server, TEXT, {"prompt": prompt, "max_tokens": 6})
    _, three = ok(server, TEXT, {"prompt": prompt, "max_tokens": 6, "n": 3,
                                 "temperature": 1.5, "seed": 7})
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    # The prompt counts once; every choice's tokens count.
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert three["usage"]["completion_tokens"] >= 3
    assert len({c["text"] for c in three["choices"]}) > 1, "three choices drew alike"
    # A seed gives the same choices again.
    _, again = ok(server, TEXT, {"prompt": prompt, "max_tokens": 6, "n": 3,
                                 "temperature": 1.5, "seed": 7})
    assert again["choices"] == three["choices"]
    for seed in (-1, 2**64 - 1, -(2**63)):
        ok(server, TEXT, {"prompt": prompt, "max_tokens": 2, "temperature": 1, "seed": seed})

    # Token ids are the same prompt as its text; prompts x n choices in order.
    ids = tokenizer.encode(prompt)
    _, by_ids = ok(server, TEXT, {"prompt": ids, "max_tokens": 6})
    assert by_ids["choices"][0]["text"] == one["choices"][0]["text"]
    _, many = ok(server, TEXT, {"prompt": [prompt, ids, words(2, 4)], "max_tokens": 6, "n": 2})
    texts = [c["text"] for c in many["choices"]]
    assert [c["index"] for c in many["choices"]] == list(range(6))
    assert texts[:4] == [one["choices"][0]["text"]] * 4

    # Streamed choices: each chunk names its choice, each choice ends once.
    _, chunks = ok(server, CHAT, {"messages": [{"role": "user", "content": prompt}],
                                  "max_tokens": 5, "n": 2, "stream": True,
                                  "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] >= 2
    finishes = [c["choices"][0]["index"] for c in chunks[:-2] if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]


def test_logprobs(server, tokenizer):
    prompt = words(3, 5)
    _, chat = ok(server, CHAT, {"messages": [{"role": "user", "content": prompt}],
                                "max_tokens": 4, "logprobs": True, "top_logprobs": 3})
    choice = chat["choices"][0]
    content = choice["logprobs"]["content"]
    # One entry per token generated (an end-of-sequence token is none).
    assert len(content) == chat["usage"]["completion_tokens"] - (choice["finish_reason"] == "stop")
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 3
        # Greedy: the token taken is the most likely.
        assert entry["top_logprobs"][0]["token"] == entry["token"]

    _, text = ok(server, TEXT, {"prompt": prompt, "max_tokens": 4, "logprobs": 2})
    logprobs = text["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    stopped = text["choices"][0]["finish_reason"] == "stop"
    assert len(logprobs["tokens"]) == text["usage"]["completion_tokens"] - stopped
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])

    # lm-evaluation-harness's loglikelihood request: the prompt scored, nothing generated.
    _, scored = ok(server, TEXT, {"prompt": prompt, "max_tokens": 0, "echo": True,
                                  "logprobs": 1})
    choice = scored["choices"][0]
    ids = tokenizer.encode(prompt)
    assert choice["text"] == prompt and scored["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"][1:])

    # Streamed: the chunks' entries are the whole response's.
    _, chunks = ok(server, CHAT, {"messages": [{"role": "user", "content": prompt}],
                                  "max_tokens": 4, "logprobs": True, "top_logprobs": 3,
                                  "stream": True})
    streamed = [e for c in chunks[:-1] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content


def test_endpoints_and_cors(server, model_dir):
    for name in ("default_model", str(model_dir)):
        status, raw = get(server, f"/v1/models/{name}")
        assert status == 200 and json.loads(raw)["object"] == "model"
    status, raw = get(server, "/v1/models/org/unknown")
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health"):
        connection = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
        connection.request("OPTIONS", path, headers={
            "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
        response = connection.getresponse()
        assert response.status == 204
        assert response.getheader("access-control-allow-origin") == "*"
    status, headers, _ = post(server, TEXT, {"prompt": "\ud800"})
    assert status == 400 and headers["access-control-allow-origin"] == "*"
    status, headers, _ = post(server, TEXT, None, raw=b"[" * 20_000 + b"]" * 20_000)
    assert status == 400


def test_keep_alive_comments_while_a_stream_feeds_its_prompt(model_dir, tmp_path):
    args = ["--model", str(model_dir), "--log-level", "WARNING", "--max-step-tokens", "8",
            "--keepalive-interval", "0.05"]
    with running_server([*NATIVE, *args], tmp_path / "keepalive.log", STARTUP_TIMEOUT_S,
                        STOP_TIMEOUT_S) as (port, _):
        # A long prompt fed 8 tokens a step: its first token is far off.
        status, _, raw = post(port, TEXT, {"prompt": words(5, 1500), "max_tokens": 3,
                                           "stream": True})
    assert status == 200 and raw.startswith(b": keep-alive\n\n")
    assert raw.endswith(b"data: [DONE]\n\n")


FAULT = """
import runpy, sys
from mlx_batched_decode.decoding.engine_core import EngineCore
real = EngineCore.run
def run(self, plan, *args, **kwargs):
    if any(%d in chunk for chunk in plan.chunks):
        raise RuntimeError("injected fault")
    if any(%d in chunk for chunk in plan.chunks):
        raise SystemExit("a fault no turn survives")
    return real(self, plan, *args, **kwargs)
EngineCore.run = run
sys.argv = ["serve", *sys.argv[1:]]
runpy.run_module("mlx_batched_decode.serve", run_name="__main__")
"""


def test_a_failing_step_ends_only_its_requests(model_dir, tmp_path):
    """A step whose prompt holds the marker token raises: that request is a 500 (an error
    event when streamed), the server stays healthy and answers the next requests alike. A
    fault that ends the decoding thread ends its request too; /health and new requests are
    503 from then on."""
    marker, fatal = VOCAB - 1, VOCAB - 2
    args = ["--model", str(model_dir), "--log-level", "CRITICAL"]
    command = [sys.executable, "-c", FAULT % (marker, fatal)]
    with running_server([*command, *args], tmp_path / "fault.log", STARTUP_TIMEOUT_S,
                        STOP_TIMEOUT_S) as (port, process):
        before = ok(port, TEXT, {"prompt": words(6, 4), "max_tokens": 5})[1]
        status, _, raw = post(port, TEXT, {"prompt": [5, marker], "max_tokens": 5})
        assert status == 500 and "injected fault" in json.loads(raw)["error"]["message"]
        status, _, raw = post(port, TEXT, {"prompt": [5, marker], "max_tokens": 5,
                                           "stream": True})
        assert status == 200 and b"injected fault" in raw
        assert get(port, "/health")[0] == 200
        after = ok(port, TEXT, {"prompt": words(6, 4), "max_tokens": 5})[1]
        assert after["choices"] == before["choices"]
        status, _, raw = post(port, TEXT, {"prompt": [5, fatal], "max_tokens": 5})
        assert status == 500 and "decoding thread is gone" in json.loads(raw)["error"]["message"]
        assert get(port, "/health")[0] == 503
        assert post(port, TEXT, {"prompt": words(6, 4), "max_tokens": 5})[0] == 503


def test_a_repo_id_from_the_local_hugging_face_cache(model_dir, tmp_path, monkeypatch):
    """``--model org/name`` offline: the snapshot in the cache's layout
    (``models--org--name/snapshots/<hash>``, ``refs/main``) is served under that name."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["--model", "org/tiny", "--log-level", "WARNING"]
    with running_server([*NATIVE, *args], tmp_path / "repo.log", STARTUP_TIMEOUT_S,
                        STOP_TIMEOUT_S) as (port, _):
        status, raw = get(port, "/v1/models")
        assert json.loads(raw)["data"][0]["id"] == "org/tiny"
        assert get(port, "/v1/models/org/tiny")[0] == 200
        status, _, raw = post(port, TEXT, {"prompt": words(7, 3), "max_tokens": 3,
                                           "model": "org/tiny"})
        assert status == 200, raw


def nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


# Values every field is tried with: wrong types, edges, huge ints, surrogates, nesting.
ODD_VALUES = [
    None, True, False, 0, 1, -1, 2, 5, 20, 21, 2**31, 2**63, 2**64, 2**70, -(2**70), 0.5,
    -0.0, 1.5, 1e308, -1e308, float("nan"), float("inf"), "", "x", "\ud800", "a\udfffb", [],
    [1], [1, 2], [-1], [[1, 2], [3]], ["a", "b"], ["a", [5]], [[]], {}, {"a": 1},
    {"1": 5}, {"5": -100, "6": 100}, {"99999999": 1}, {"type": "text"}, {"include_usage": True},
    {"type": "json_object"}, nested(30), nested(80), [{"role": "user", "content": "\ud800"}],
    [{"role": "user", "content": [{"type": "text", "text": "w9"}]}], [{"role": 5}],
]
FIELDS = [
    "prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "repetition_penalty", "repetition_context_size",
    "presence_penalty", "presence_context_size", "frequency_penalty", "frequency_context_size",
    "logit_bias", "xtc_probability", "xtc_threshold", "seed", "logprobs", "top_logprobs",
    "echo", "n", "stop", "stream", "stream_options", "chat_template_kwargs", "user", "tools",
    "tool_choice", "response_format", "suffix", "best_of", "modalities", "metadata",
    "unknown_field",
]


def fuzz_bodies(count, seed=0):
    """``count`` (path, raw body) pairs: valid small requests with 1-3 fields mutated, and
    now and then a body that is no object or no JSON at all."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        path = rng.choice([TEXT, CHAT])
        body = ({"prompt": words(i, 1 + i % 5)} if path == TEXT
                else {"messages": [{"role": "user", "content": words(i, 3)}]})
        body["max_tokens"] = rng.choice([1, 2, 3])
        for name in rng.sample(FIELDS, rng.randint(1, 3)):
            body[name] = rng.choice(ODD_VALUES)
        if body.get("max_tokens") in (2**63, 2**64, 2**70) and rng.random() < 0.5:
            body["max_tokens"] = 4
        roll = rng.random()
        if roll < 0.03:
            raw = b"[" * 20_000 + b"]" * 20_000
        elif roll < 0.06:
            raw = json.dumps(rng.choice(ODD_VALUES)).encode()
        elif roll < 0.08:
            raw = b'{"prompt": "w9", "seed": ' + b"9" * 5000 + b"}"
        else:
            raw = json.dumps(body).encode()
        out.append((path, raw))
    return out


def test_fuzzed_bodies_never_break_the_server(server):
    greedy = {"prompt": words(8, 6), "max_tokens": 8}
    before = ok(server, TEXT, greedy)[1]["choices"]
    bodies = fuzz_bodies(300)
    lock, statuses = threading.Lock(), {}

    def send(item):
        path, raw = item
        status, _, answer = post(server, path, None, raw=raw)
        with lock:
            statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (raw[:300], answer[:300])
        if status >= 400:
            assert set(json.loads(answer)["error"]) == {"message", "type", "code"}

    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(send, bodies))
    assert time.monotonic() - started < 60
    assert statuses.get(200, 0) > 20 and sum(statuses.values()) == len(bodies)
    assert get(server, "/health")[0] == 200
    assert ok(server, TEXT, greedy)[1]["choices"] == before


def test_echoed_choices_streamed_equal_whole(server):
    """Two prompts x 2 choices, echoed with logprobs: the stream's pieces of each choice join
    into the whole response's choice."""
    body = {"prompt": [words(9, 4), words(10, 3)], "max_tokens": 3, "n": 2, "echo": True,
            "logprobs": 2}
    whole = ok(server, TEXT, body)[1]["choices"]
    chunks = ok(server, TEXT, {**body, "stream": True})[1][:-1]
    for choice in whole:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert [x for c in mine for x in c["logprobs"][key]] == choice["logprobs"][key]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
    assert whole[0]["text"].startswith(words(9, 4)) and whole[2]["text"].startswith(words(10, 3))


@pytest.fixture(scope="module")
def served_model(model_dir):
    from mlx_lm.utils import load

    return load(str(model_dir))[0]


def test_logprob_values_equal_a_direct_forward_pass(server, tokenizer, served_model):
    import numpy as np

    ids = tokenizer.encode(words(11, 7))
    _, text = ok(server, TEXT, {"prompt": ids, "max_tokens": 6, "logprobs": 3})
    logprobs = text["choices"][0]["logprobs"]
    by_text = {tokenizer.decode([i]): i for i in range(VOCAB)}
    generated = [by_text[t] for t in logprobs["tokens"]]
    want = direct_logprobs(served_model, ids + generated)
    for i, (token, value, top) in enumerate(
        zip(generated, logprobs["token_logprobs"], logprobs["top_logprobs"])
    ):
        row = want[len(ids) + i - 1]
        assert abs(value - row[token]) < 1e-3
        best = np.argsort(-row)[:3]
        assert [by_text[t] for t in top] == list(best)
        assert np.allclose(list(top.values()), row[best], atol=1e-3)
    # The whole sequence echoed and scored, nothing generated: each token given those before.
    _, scored = ok(server, TEXT, {"prompt": ids + generated, "max_tokens": 0, "echo": True,
                                  "logprobs": 1})
    values = scored["choices"][0]["logprobs"]["token_logprobs"]
    assert values[0] is None
    sequence = ids + generated
    assert np.allclose(values[1:], [want[p - 1, sequence[p]] for p in range(1, len(sequence))],
                       atol=1e-3)
    # Chat, sampled: each content entry's logprob (before temperature), its token the sampled one.
    _, chat = ok(server, CHAT, {"messages": [{"role": "user", "content": words(12, 5)}],
                                "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
                                "temperature": 0.7, "seed": 3})
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": words(12, 5)}],
                                           add_generation_prompt=True)
    content = chat["choices"][0]["logprobs"]["content"]
    sampled = [by_text[e["token"]] for e in content]
    want = direct_logprobs(served_model, list(prompt) + sampled)
    for i, (token, entry) in enumerate(zip(sampled, content)):
        assert abs(entry["logprob"] - want[len(prompt) + i - 1, token]) < 1e-3


def test_truncation_to_one_token_samples_greedily_and_seeds_ignore_their_batch(server):
    """``top_k: 1`` and ``min_p: 1.0`` at temperature 1 leave only the most likely token; a
    seeded request's answer alone equals its answer among requests with other knobs."""
    prompt = words(13, 6)
    greedy = ok(server, TEXT, {"prompt": prompt, "max_tokens": 8})[1]["choices"][0]["text"]
    for knob in ({"top_k": 1}, {"min_p": 1.0}):
        for seed in (1, 2):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": seed, **knob}
            assert ok(server, TEXT, body)[1]["choices"][0]["text"] == greedy
    seeded = {"prompt": prompt, "max_tokens": 8, "temperature": 1.2, "seed": 99, "top_p": 0.95,
              "min_p": 0.02, "repetition_penalty": 1.2}
    alone = ok(server, TEXT, seeded)[1]["choices"][0]["text"]
    others = [{"prompt": words(14 + i, 3 + i), "max_tokens": 10, "temperature": 0.5 + i / 4,
               "top_k": 5 + i, "presence_penalty": 0.5, "logit_bias": {str(20 + i): 3.0}}
              for i in range(5)]
    with ThreadPoolExecutor(6) as pool:
        batched = pool.map(lambda body: ok(server, TEXT, body)[1], [*others, seeded])
        answers = list(batched)
    assert answers[-1]["choices"][0]["text"] == alone


def test_the_openai_client_reads_logprobs_scores_and_choices(server):
    """docs/server.md's examples, with the words of this model: the official client parses
    every answer into its types."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="none", max_retries=0,
                    timeout=60)
    chat = client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": words(15, 4)}],
        max_tokens=8, logprobs=True, top_logprobs=3,
    )
    for entry in chat.choices[0].logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token

    context, continuation = words(16, 5), " " + words(17, 2)

    def scored(prompt):
        answer = client.completions.create(model="default_model", prompt=prompt, max_tokens=0,
                                           echo=True, logprobs=1)
        return answer.choices[0].logprobs

    whole, alone = scored(context + continuation), scored(context)
    count = len(whole.tokens) - len(alone.tokens)
    assert count == 2 and whole.tokens[: len(alone.tokens)] == alone.tokens
    assert whole.token_logprobs[0] is None and alone.token_logprobs[0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(whole.token_logprobs[1:], alone.token_logprobs[1:]))
    assert sum(whole.token_logprobs[-count:]) < 0

    four = client.completions.create(
        model="default_model", prompt=words(18, 4), max_tokens=6, n=4, temperature=0.8,
        seed=7, extra_body={"top_k": 40},
    )
    assert [choice.index for choice in four.choices] == [0, 1, 2, 3]
    assert four.usage.prompt_tokens == len(words(18, 4).split())


SLOW_TOKENIZER = """
import runpy, sys, time
from mlx_batched_decode.server import app
real = app._tokenize
def tokenize(state, request):
    if "slowly" in str(request.prompts):
        time.sleep(2.0)
    return real(state, request)
app._tokenize = tokenize
sys.argv = ["serve", *sys.argv[1:]]
runpy.run_module("mlx_batched_decode.serve", run_name="__main__")
"""


def test_tokenizing_leaves_the_streams_flowing(model_dir, tokenizer, tmp_path):
    """A prompt that takes 2 s to tokenize: a stream open meanwhile keeps getting its tokens
    (the tokenizer runs off the event loop)."""
    args = ["--model", str(model_dir), "--log-level", "WARNING"]
    command = [sys.executable, "-c", SLOW_TOKENIZER]
    with running_server([*command, *args], tmp_path / "slow.log", STARTUP_TIMEOUT_S,
                        STOP_TIMEOUT_S) as (port, _):
        arrivals, slow_sent = [], []
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        # No end-of-sequence token: the stream runs its 3,000 tokens (several seconds).
        body = {"prompt": words(19, 4), "max_tokens": 3000, "stream": True,
                "logit_bias": {str(t): -100 for t in tokenizer.eos_token_ids}}
        connection.request("POST", TEXT, body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200

        def slow():
            slow_sent.append(time.monotonic())
            post(port, TEXT, {"prompt": "slowly " + words(20, 3), "max_tokens": 2})

        worker = None
        while line := response.readline():
            if line.startswith(b"data: {"):
                arrivals.append(time.monotonic())
                if len(arrivals) == 5:
                    worker = threading.Thread(target=slow)
                    worker.start()
        worker.join()
    start = slow_sent[0]
    during = [t for t in arrivals if start + 0.3 < t < start + 1.7]
    assert arrivals[-1] > start + 2.0, "the stream ended before the slow tokenizing did"
    assert len(during) > 5
