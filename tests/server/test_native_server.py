"""End to end: ``python -m mlx_batched_decode.serve`` (the native server) on 127.0.0.1, on a
small random-weight model folder, every server stopped at the end.

- its greedy responses (text and chat, whole and streamed, with usage; with each logits
  processor: penalties and logit_bias) equal mlx_lm.server's
  byte for byte but for ids, times and fingerprints;
- bad input and faults: 4xx with OpenAI's error body, never 500; a full queue is 503 with
  Retry-After; a client that hangs up frees its blocks; SIGTERM ends in-flight requests
  cleanly and exits 0;
- each decoder flag through HTTP: paged + prefix sharing (cached tokens), ``--kv-bits``,
  ``--draft-model`` (acceptance in ``/metrics``), ``/metrics`` read with prometheus_client's
  parser;
- ``--tensor-parallel`` over 2 ranks under mlx.launch.
"""

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

from mlx_batched_decode.tools.local_server import free_port, healthy, running_server  # noqa: E402
from mlx_batched_decode.tools.model_folder import (  # noqa: E402
    SPECIAL_TOKENS,
    save_model_folder,
    word,
)

from tests.support.mlx_lm_models import SERVED_LLAMA as CONFIG  # noqa: E402

VOCAB = CONFIG["vocab_size"]
REQUEST_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
NATIVE = [sys.executable, "-m", "mlx_batched_decode.serve"]
# Fields that differ between any two responses.
VOLATILE = ("id", "created", "system_fingerprint")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_folder(CONFIG, tmp_path_factory.mktemp("model"), seed=5)


def words(i, n):
    return " ".join(
        word(len(SPECIAL_TOKENS) + (i * 7 + 3 * j) % (VOCAB - len(SPECIAL_TOKENS)))
        for j in range(n)
    )


def post(port, path, body, raw=None):
    """(status, headers by lower-case name, body bytes) of one POST."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    data = raw if raw is not None else json.dumps(body).encode()
    connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    headers = {name.lower(): value for name, value in response.getheaders()}
    return response.status, headers, response.read()


def get(port, path):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    connection.request("GET", path)
    response = connection.getresponse()
    return response.status, response.read()


def stable(body):
    """A response body without its volatile fields."""
    return {k: v for k, v in body.items() if k not in VOLATILE}


def events(raw):
    """A stream's data events (comments such as mlx_lm.server's keepalives left out)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else stable(json.loads(data)))
    return out


def metrics(port):
    status, text = get(port, "/metrics")
    assert status == 200
    # Labelled samples as name{label=value,...}.
    return {
        sample.name + ("{%s}" % ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                       if sample.labels else ""): sample.value
        for family in parser.text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


REQUESTS = [
    ("/v1/completions", {"prompt": words(1, 9), "max_tokens": 12}),
    ("/v1/completions", {"prompt": words(2, 30), "max_tokens": 7, "stop": [words(3, 1)]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": words(4, 12)}],
                              "max_tokens": 10}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": words(5, 3)},
                                           {"role": "user", "content": words(6, 20)}],
                              "max_tokens": 9, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": words(7, 5), "max_tokens": 8, "stream": True}),
    # Each logits processor of mlx_lm.server, greedy: the same answers.
    ("/v1/completions", {"prompt": words(13, 14), "max_tokens": 12, "repetition_penalty": 1.6,
                         "repetition_context_size": 8}),
    ("/v1/completions", {"prompt": words(9, 10), "max_tokens": 12, "presence_penalty": 1.5,
                         "frequency_penalty": 0.8, "frequency_context_size": 30}),
    ("/v1/completions", {"prompt": words(10, 8), "max_tokens": 10,
                         "logit_bias": {"17": 6.0, "40": -100}}),
    ("/v1/completions", {"prompt": words(11, 6), "max_tokens": 10, "stream": True,
                         "logit_bias": {"23": 2.5}, "repetition_penalty": 1.3}),
]


def answers(port):
    """Each of ``REQUESTS``' responses: the stable body, or the stream's events."""
    out = []
    for path, body in REQUESTS:
        status, headers, raw = post(port, path, {**body, "temperature": 0})
        assert status == 200, raw
        out.append(events(raw) if body.get("stream") else stable(json.loads(raw)))
    return out


def test_greedy_responses_equal_mlx_lm_servers(model_dir, tmp_path):
    args = ["--model", str(model_dir), "--log-level", "WARNING"]
    results = {}
    for name, command in (("mlx-lm", [sys.executable, "-m", "mlx_lm", "server"]),
                          ("native", NATIVE)):
        with running_server([*command, *args], tmp_path / f"{name}.log", STARTUP_TIMEOUT_S,
                            STOP_TIMEOUT_S) as (port, _):
            results[name] = answers(port)
    assert results["native"] == results["mlx-lm"]
    # The requests ran to their stop string and to their budgets.
    finishes = [r[-3]["choices"][0]["finish_reason"] if isinstance(r, list)
                else r["choices"][0]["finish_reason"] for r in results["native"]]
    assert "length" in finishes


def error_of(status_headers_raw, status):
    got, _, raw = status_headers_raw
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "code"}
    return error


def test_bad_input_faults_and_paged_sharing(model_dir, tmp_path):
    args = ["--model", str(model_dir), "--log-level", "WARNING", "--kv-layout", "paged",
            "--block-size", "8", "--max-kv-blocks", "64", "--max-batch-size", "2",
            "--max-queue", "2", "--max-context-length", "4000"]
    with running_server([*NATIVE, *args], tmp_path / "paged.log", STARTUP_TIMEOUT_S,
                        STOP_TIMEOUT_S) as (port, process):
        chat = "/v1/chat/completions"
        error_of(post(port, chat, None, raw=b"{not json"), 400)
        error_of(post(port, chat, None, raw=b"\xff\xfe"), 400)
        error_of(post(port, chat, {"model": "x"}), 400)
        error_of(post(port, "/v1/completions", {"prompt": ""}), 400)
        error_of(post(port, "/v1/completions", {"prompt": "w9", "max_tokens": -1}), 400)
        error_of(post(port, "/v1/completions", {"prompt": "w9", "max_tokens": 10**12}), 400)
        error_of(post(port, "/v1/completions", {"prompt": "w9", "temperature": "hot"}), 400)
        unknown = error_of(post(port, "/v1/completions", {"prompt": "w9", "model": "gpt"}), 404)
        assert unknown["code"] == "model_not_found"
        context = error_of(post(port, "/v1/completions",
                                {"prompt": words(1, 10), "max_tokens": 3995}), 400)
        assert context["code"] == "context_length_exceeded"
        # Within the context length, beyond the 64 blocks of 8 positions.
        budget = error_of(post(port, "/v1/completions",
                               {"prompt": words(1, 10), "max_tokens": 600}), 400)
        assert budget["code"] == "kv_budget_exceeded"
        error_of(post(port, "/v1/nothing", {}), 404)
        status, _ = get(port, "/v1/completions")
        assert status == 405
        for name in ("default_model", str(model_dir)):
            status, _, _ = post(port, "/v1/completions",
                                {"prompt": "w9", "max_tokens": 2, "model": name})
            assert status == 200

        # Prefix sharing: the same long prompt twice, the second takes its cached blocks.
        prompt = {"prompt": words(8, 40), "max_tokens": 3}
        first = json.loads(post(port, "/v1/completions", prompt)[2])
        second = json.loads(post(port, "/v1/completions", prompt)[2])
        assert first["choices"] == second["choices"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        assert metrics(port)["mbd_prefix_hit_tokens_total"] >= 32

        # 2 run and 2 wait; the rest, arriving at once, are refused before any work. (Each
        # holds 38 of the 64 blocks: the decoder runs one at a time.)
        barrier = threading.Barrier(7)

        def long_request(_):
            barrier.wait()
            return post(port, "/v1/completions", {"prompt": words(9, 4), "max_tokens": 300})

        with ThreadPoolExecutor(7) as pool:
            replies = list(pool.map(long_request, range(7)))
        statuses = sorted(status for status, _, _ in replies)
        assert statuses == [200] * 4 + [503] * 3
        busy = [r for r in replies if r[0] == 503][0]
        assert busy[1].get("retry-after") == "1"
        assert json.loads(busy[2])["error"]["code"] == "queue_full"

        # A client that hangs up mid-stream: its blocks are free within a step or two.
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
        connection.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": words(10, 6), "max_tokens": 500, "stream": True}).encode())
        response = connection.getresponse()
        response.fp.readline()
        deadline = time.monotonic() + 30
        while not metrics(port)["mbd_kv_cache_usage"]:
            assert time.monotonic() < deadline, "the streaming request holds no block"
            time.sleep(0.01)
        connection.close()
        while metrics(port)["mbd_num_requests_running"] or metrics(port)["mbd_kv_cache_usage"]:
            assert time.monotonic() < deadline, "the hung-up request still holds its blocks"
            time.sleep(0.1)
        assert metrics(port)["mbd_requests_total{finish_reason=cancelled}"] == 1

        # A client of a whole response that hangs up is cancelled too.
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
        connection.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": words(10, 6), "max_tokens": 500}).encode())
        while not metrics(port)["mbd_kv_cache_usage"]:
            assert time.monotonic() < deadline + 30, "the request holds no block"
            time.sleep(0.01)
        connection.close()
        while metrics(port)["mbd_requests_total{finish_reason=cancelled}"] < 2:
            assert time.monotonic() < deadline + 60, "the hung-up request was not cancelled"
            time.sleep(0.1)
        assert metrics(port)["mbd_kv_cache_usage"] == 0

        # SIGTERM with a request in flight: it ends whole, the server exits 0.
        with ThreadPoolExecutor(1) as pool:
            last = pool.submit(post, port, "/v1/completions",
                               {"prompt": words(11, 4), "max_tokens": 450, "stream": True})
            time.sleep(0.5)
            process.send_signal(signal.SIGTERM)
            status, _, raw = last.result(timeout=REQUEST_TIMEOUT_S)
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
        assert process.wait(STOP_TIMEOUT_S) == 0


def texts(port, prompts, max_tokens):
    return [
        json.loads(post(port, "/v1/completions",
                        {"prompt": p, "max_tokens": max_tokens})[2])["choices"][0]["text"]
        for p in prompts
    ]


def test_kv_bits_and_draft_model_flags(model_dir, tmp_path):
    from mlx_lm.utils import load

    from mlx_batched_decode.decoding.decoder import BatchedDecoder

    prompts = [words(12, 7), words(13, 19)]
    model, tokenizer = load(str(model_dir))
    tokens = [tokenizer.encode(p) for p in prompts]
    eos = tokenizer.eos_token_ids
    expected = {
        "kv-bits": BatchedDecoder(model, kv_bits=8, kv_group_size=32).generate(
            tokens, 10, stop_tokens=eos
        ),
        "draft": BatchedDecoder(model).generate(tokens, 10, stop_tokens=eos),
    }
    base = ["--model", str(model_dir), "--log-level", "WARNING"]
    flags = {"kv-bits": ["--kv-bits", "8", "--kv-group-size", "32"],
             "draft": ["--draft-model", str(model_dir), "--num-draft-tokens", "3"]}
    for name, extra in flags.items():
        with running_server([*NATIVE, *base, *extra], tmp_path / f"{name}.log",
                            STARTUP_TIMEOUT_S, STOP_TIMEOUT_S) as (port, _):
            assert texts(port, prompts, 10) == [tokenizer.decode(t) for t in expected[name]]
            counts = metrics(port)
        if name == "draft":
            # The draft is the target itself: every proposal is accepted.
            assert counts["mbd_draft_tokens_total"] > 0
            assert counts["mbd_accepted_draft_tokens_total"] == counts["mbd_draft_tokens_total"]
        assert counts["mbd_generation_tokens_total"] >= sum(map(len, expected[name]))


def test_hang_ups_among_many_requests(model_dir, tmp_path):
    """200 streaming requests, 16 at a time, every third client hanging up after its first
    chunk: every other request is answered in full, and nothing is held after."""
    args = ["--model", str(model_dir), "--log-level", "WARNING", "--kv-layout", "paged",
            "--block-size", "8", "--max-batch-size", "8", "--max-queue", "16"]

    def one(port, i):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
        connection.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": words(i, 3 + i % 20), "max_tokens": 40, "stream": True}).encode())
        response = connection.getresponse()
        if i % 3 == 0:
            response.fp.readline()
            connection.close()
            return None
        raw = response.read()
        connection.close()
        return response.status, raw

    with running_server([*NATIVE, *args], tmp_path / "hangups.log", STARTUP_TIMEOUT_S,
                        STOP_TIMEOUT_S) as (port, _):
        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda i: one(port, i), range(200)))
        answered = [r for r in replies if r is not None]
        assert len(answered) == 133
        for status, raw in answered:
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
            finish = events(raw)[-2]["choices"][0]["finish_reason"]
            assert finish in ("stop", "length")
        deadline = time.monotonic() + 30
        while (counts := metrics(port))["mbd_num_requests_running"] or counts[
            "mbd_kv_cache_usage"
        ]:
            assert time.monotonic() < deadline, f"still held after the clients left: {counts}"
            time.sleep(0.1)
        assert counts["mbd_requests_total{finish_reason=cancelled}"] <= 67


def _rank_zero(launcher_pid):
    """The pid of rank 0 among the launcher's children (its environment says MLX_RANK=0); each
    was started by one of the launcher's threads."""
    tasks = Path(f"/proc/{launcher_pid}/task").iterdir()
    children = [pid for task in tasks for pid in (task / "children").read_text().split()]
    for pid in children:
        if b"MLX_RANK=0\0" in Path(f"/proc/{pid}/environ").read_bytes() + b"\0":
            return int(pid)
    return None


def test_tensor_parallel_over_two_ranks(model_dir, tmp_path):
    """Under mlx.launch (2 ranks, ring backend on 127.0.0.1) rank 0 serves HTTP and both step
    the sharded model in lockstep: greedy texts equal the unsharded model's, requests of any
    temperature come back whole, and SIGTERM to rank 0 stops every rank with status 0."""
    from mlx_lm.utils import load

    from mlx_batched_decode.decoding.decoder import BatchedDecoder
    from tests.integrations.test_tensor_parallel import LAUNCHER, _free_port_pair

    if not LAUNCHER.exists():
        pytest.skip(f"{LAUNCHER} not found")
    model, tokenizer = load(str(model_dir))
    prompts = [words(14, 5), words(15, 23), words(16, 11)]
    tokens = [tokenizer.encode(p) for p in prompts]
    expected = BatchedDecoder(model).generate(tokens, 12, stop_tokens=tokenizer.eos_token_ids)
    port = free_port()
    log = open(tmp_path / "tp.log", "wb")
    launcher = subprocess.Popen(
        [str(LAUNCHER), "-n", "2", "--backend", "ring", "--starting-port",
         str(_free_port_pair()), "--python", sys.executable, "--", "-m",
         "mlx_batched_decode.serve", "--tensor-parallel", "--model", str(model_dir),
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not healthy(port):
            assert launcher.poll() is None, (tmp_path / "tp.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "tp.log").read_text()
            time.sleep(0.2)
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: texts(port, [p], 12)[0], prompts))
        assert got == [tokenizer.decode(t) for t in expected]
        sampled = json.loads(post(port, "/v1/completions", {
            "prompt": prompts[0], "max_tokens": 12, "temperature": 0.8})[2])
        assert sampled["choices"][0]["finish_reason"] in ("stop", "length")
        os.kill(_rank_zero(launcher.pid), signal.SIGTERM)
        assert launcher.wait(STOP_TIMEOUT_S) == 0, (tmp_path / "tp.log").read_text()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        log.close()
