"""End to end: ``python -m mlx_batched_decode.serve`` against mlx-lm's own server, with the
official ``openai`` client.

A random-weight model (one sliding-window layer, one full layer) and a word-level tokenizer are
written to a temporary folder with mlx-lm's and ``tokenizers``' own save functions. Each server
runs on 127.0.0.1 on a free port and gets the same workload: malformed requests (each must get a
4xx), a client that disconnects mid-stream, 16 concurrent greedy requests (streaming and not,
chat and plain completions, prompts of mixed lengths, different budgets), then one more
malformed and one more good request. Every response of the plug-in server must equal the mlx-lm
server's. Requests are bounded in count and time, and each server process is stopped whatever
happens.
"""

import http.client
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")

from mlx_batched_decode.tools.local_server import healthy, running_server  # noqa: E402
from mlx_batched_decode.tools.model_folder import SPECIAL_TOKENS, save_model_folder, word  # noqa: E402

from tests.support.mlx_lm_models import SERVED_LLAMA_SLIDING as CONFIG  # noqa: E402

VOCAB = CONFIG["vocab_size"]
CONCURRENT = 16
REQUEST_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_folder(CONFIG, tmp_path_factory.mktemp("model"), seed=3)


def _prompt_words(i):
    # Mixed lengths from 1 to 57 words, some past the sliding window of 48.
    n = 1 + (i * 23) % 58
    return " ".join(
        word(len(SPECIAL_TOKENS) + (i * 7 + 3 * j) % (VOCAB - len(SPECIAL_TOKENS)))
        for j in range(n)
    )


def _one_request(client, i):
    """Request i of the concurrent batch: chat or plain, streaming or not, greedy."""
    chat, stream = i % 2 == 0, (i // 2) % 2 == 0
    kwargs = dict(model="default_model", max_tokens=4 + (i * 5) % 21, temperature=0, stream=stream)
    if chat:
        messages = [{"role": "user", "content": _prompt_words(i)}]
        response = client.chat.completions.create(messages=messages, **kwargs)
    else:
        response = client.completions.create(prompt=_prompt_words(i), **kwargs)
    if not stream:
        choice = response.choices[0]
        return choice.message.content if chat else choice.text, choice.finish_reason
    text, finish = "", None
    for chunk in response:
        if chunk.choices:
            delta = chunk.choices[0].delta.content if chat else chunk.choices[0].text
            text += delta or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _raw_post(port, path, body):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    return connection.getresponse().status


def _malformed_requests_get_4xx(port, client):
    assert _raw_post(port, "/v1/chat/completions", b"{not json") == 400
    assert _raw_post(port, "/v1/chat/completions", json.dumps({"model": "x"}).encode()) == 400
    assert _raw_post(port, "/v1/nothing", b"{}") == 404
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": "w9"}], max_tokens=0
        )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default_model", prompt="w9", temperature="hot")


def _disconnect_mid_stream(client):
    """Start a long streaming request, read two chunks, hang up."""
    stream = client.chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": _prompt_words(5)}],
        max_tokens=2000,
        temperature=0,
        stream=True,
    )
    for n, _ in enumerate(stream):
        if n == 1:
            break
    stream.close()


def _workload(port):
    """The same requests against either server; returns the 16 concurrent responses and the
    final one."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="unused",
        timeout=REQUEST_TIMEOUT_S,
        max_retries=0,
    )
    _malformed_requests_get_4xx(port, client)
    with ThreadPoolExecutor(CONCURRENT + 1) as pool:
        hang_up = pool.submit(_disconnect_mid_stream, client)
        futures = [pool.submit(_one_request, client, i) for i in range(CONCURRENT)]
        responses = [f.result(timeout=4 * REQUEST_TIMEOUT_S) for f in futures]
        hang_up.result(timeout=REQUEST_TIMEOUT_S)
    # Still serving after all of it.
    assert _raw_post(port, "/v1/completions", b"[1, 2]") == 400
    final = _one_request(client, CONCURRENT)
    assert healthy(port)
    return responses, final


def test_plugin_server_answers_like_mlx_lm_server(model_dir, tmp_path):
    args = ["--model", str(model_dir), "--log-level", "WARNING"]
    results, logs = {}, {}
    plugin = [sys.executable, "-m", "mlx_batched_decode.serve", "--engine", "mlx-lm"]
    for name, command in (
        ("mlx-lm", [sys.executable, "-m", "mlx_lm", "server", *args]),
        ("plug-in", [*plugin, *args]),
    ):
        logs[name] = tmp_path / f"{name}.log"
        with running_server(command, logs[name], STARTUP_TIMEOUT_S, STOP_TIMEOUT_S) as (port, process):
            results[name] = _workload(port)
        assert process.returncode is not None

    responses, final = results["plug-in"]
    assert (responses, final) == results["mlx-lm"]
    # The workload is not trivial: every kind of ending, texts of many lengths.
    assert {finish for _, finish in responses} >= {"length"}
    assert len({len(text) for text, _ in responses}) > 8
    # The plug-in server stopped cleanly and reports that the op served its decode steps.
    log = logs["plug-in"].read_text()
    served = re.search(r"batched_decode_attention served (\d+) attention calls", log)
    assert served and int(served.group(1)) > 0, log
