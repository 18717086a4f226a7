"""The server's decoding thread in-process, on a small random-weight model folder: what it
accepts, what a failing step or a cancel does to the requests held, and the text of each
request's tokens against the decoder's own tokens."""

import asyncio

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

from mlx_batched_decode.decoding.config import EngineConfig, SchedulerConfig  # noqa: E402
from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.decoding.engine_core import EngineCore  # noqa: E402
from mlx_batched_decode.decoding.plan import Snapshot  # noqa: E402
from mlx_batched_decode.decoding.sampling_params import SamplingParams  # noqa: E402
from mlx_batched_decode.server.engine import Choice, Engine, Submission  # noqa: E402
from mlx_batched_decode.server.metrics import ServerMetrics  # noqa: E402
from mlx_batched_decode.server.protocol import APIError  # noqa: E402
from mlx_batched_decode.server.text_stream import TextStream  # noqa: E402
from mlx_batched_decode.tools.model_folder import save_model_folder  # noqa: E402
from tests.support.mlx_lm_models import DEEPSEEK_V3, GEMMA2, LLAMA, mlx_lm_greedy  # noqa: E402

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from mlx_lm.utils import load

    path = save_model_folder({**LLAMA, "vocab_size": 64}, tmp_path_factory.mktemp("m"), seed=2)
    return load(str(path))


def core(model, max_batch_size):
    """An engine core of ``model`` running at most ``max_batch_size`` requests."""
    return EngineCore(model, EngineConfig(scheduler=SchedulerConfig(max_batch_size=max_batch_size)))


def metric(metrics, name, **labels):
    """A sample's value in ``metrics``' registry (``None``: none such)."""
    return metrics.registry.get_sample_value(name, labels)


def submission(tokenizer, prompt, max_tokens, stop=(), n=1, **knobs):
    """A request of ``n`` choices (greedy unless ``knobs`` say otherwise) ending at the
    tokenizer's end-of-sequence ids, as the server's."""
    choices = [Choice(j, TextStream(tokenizer, stop, max_tokens)) for j in range(n)]
    return Submission(
        list(prompt), max_tokens, choices, SamplingParams(**knobs), asyncio.get_running_loop(),
        asyncio.Queue(),
        stop_tokens=tokenizer.eos_token_ids,
    )


async def drain(sub):
    """Every piece of ``sub`` until it ends."""
    pieces = []
    while (piece := await asyncio.wait_for(sub.pieces.get(), TIMEOUT_S)) is not None:
        pieces.append(piece)
    return pieces


async def serve_all(engine, tokenizer, prompts, max_tokens):
    """Start ``engine``, submit one request per prompt, drain them all and stop it: the pieces
    of each."""
    engine.start()
    subs = [submission(tokenizer, p, max_tokens) for p in prompts]
    for sub in subs:
        engine.submit([sub])
    results = [await drain(sub) for sub in subs]
    engine.stop(TIMEOUT_S)
    return results


def test_accepts_batch_plus_queue_then_503(loaded):
    model, tokenizer = loaded

    async def main():
        engine = Engine(core(model, 2), ServerMetrics(), max_queue=3)
        for _ in range(5):
            engine.submit([submission(tokenizer, [7, 8], 4)])
        with pytest.raises(APIError) as refused:
            engine.submit([submission(tokenizer, [7, 8], 4)])
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}

    asyncio.run(main())


def test_texts_equal_the_decoders_tokens_and_counts_come_back(loaded):
    model, tokenizer = loaded
    prompts = [[9, 10, 11, 12], [20, 21], [30, 31, 32, 33, 34, 35]]
    # The server ends a request at its end-of-sequence token, which it never shows.
    expected = BatchedDecoder(model).generate(prompts, 6, stop_tokens=tokenizer.eos_token_ids)

    async def main():
        metrics = ServerMetrics()
        engine = Engine(core(model, 2), metrics, max_queue=4)
        results = await serve_all(engine, tokenizer, prompts, 6)
        assert not engine.alive and engine.accepted == 0
        # The engine keeps nothing of a finished request.
        assert engine.core.snapshot() == Snapshot(0, 0, 0, 2)
        assert not engine.core.runner.samplers
        return results, metrics

    results, metrics = asyncio.run(main())
    assert any(len(tokens) < 6 for tokens in expected), "no request met its end token"
    for pieces, tokens in zip(results, expected):
        assert "".join(p.text for p in pieces) == tokenizer.decode(tokens)
        finish = "length" if len(tokens) == 6 else "stop"
        assert [p.finish_reason for p in pieces] == [None] * (len(pieces) - 1) + [finish]
    # Finishes are counted by their reason: an end-of-sequence token is no cancel.
    stops = sum(len(t) < 6 for t in expected)
    assert metric(metrics, "mbd_requests_total", finish_reason="stop") == stops
    assert metric(metrics, "mbd_requests_total", finish_reason="length") == len(prompts) - stops
    assert metric(metrics, "mbd_requests_total", finish_reason="cancelled") is None


def test_a_failing_step_ends_its_requests_and_the_thread_goes_on(loaded, monkeypatch):
    model, tokenizer = loaded
    engine_core = core(model, 4)
    real_run, calls = engine_core.run, []

    def run(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(engine_core, "run", run)

    async def main():
        engine = Engine(engine_core, ServerMetrics(), max_queue=4)
        engine.start()
        first = submission(tokenizer, [9, 10, 11], 8)
        engine.submit([first])
        await drain(first)
        assert first.error is not None and "injected" in first.error
        assert engine_core.snapshot().running == 0
        later = submission(tokenizer, [9, 10, 11], 3)
        engine.submit([later])
        pieces = await drain(later)
        engine.stop(TIMEOUT_S)
        return later, pieces

    later, pieces = asyncio.run(main())
    assert later.error is None and pieces[-1].finish_reason == "length"
    assert later.completion_tokens == 3


def test_a_fault_outside_a_step_ends_what_it_held_and_the_thread_goes_on(loaded, monkeypatch):
    """``schedule`` raising (the engine's state unknown): every request held ends with an
    error, nothing stays accepted, the thread lives and serves the next request."""
    model, tokenizer = loaded
    engine_core = core(model, 4)
    real_schedule, calls = engine_core.schedule, []

    def schedule():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real_schedule()

    monkeypatch.setattr(engine_core, "schedule", schedule)

    async def main():
        engine = Engine(engine_core, ServerMetrics(), max_queue=4)
        engine.start()
        held = [submission(tokenizer, [9 + i, 10, 11], 8) for i in range(2)]
        for sub in held:
            engine.submit([sub])
        for sub in held:
            await drain(sub)
        assert all("injected" in sub.error for sub in held)
        assert engine.alive and engine.accepted == 0
        assert engine_core.snapshot().running == 0
        later = submission(tokenizer, [9, 10, 11], 3)
        engine.submit([later])
        pieces = await drain(later)
        engine.stop(TIMEOUT_S)
        return engine, later, pieces

    engine, later, pieces = asyncio.run(main())
    assert later.error is None and pieces[-1].finish_reason == "length"
    assert not engine.alive


def test_cancel_frees_the_slot_within_a_step(loaded):
    model, tokenizer = loaded

    async def main():
        engine = Engine(core(model, 2), ServerMetrics(), max_queue=0)
        engine.start()
        long = submission(tokenizer, [9, 10, 11], 10_000)
        engine.submit([long])
        await asyncio.wait_for(long.pieces.get(), TIMEOUT_S)  # it runs
        engine.cancel(long)
        assert await drain(long) is not None and long.ended
        # Its place is free again: a full batch is accepted.
        for _ in range(2):
            engine.submit([submission(tokenizer, [12], 2)])
        engine.stop(TIMEOUT_S)
        return engine

    engine = asyncio.run(main())
    assert engine.core.snapshot().running == 0 and engine.accepted == 0


def test_stop_strings_end_a_request_and_are_not_shown(loaded):
    model, tokenizer = loaded
    tokens = BatchedDecoder(model).generate([[9, 10, 11]], 8)[0]
    words = tokenizer.decode(tokens).split()
    stop = " ".join(words[3:5])

    async def main():
        engine = Engine(core(model, 1), ServerMetrics(), max_queue=0)
        engine.start()
        sub = submission(tokenizer, [9, 10, 11], 8, stop=[stop])
        engine.submit([sub])
        pieces = await drain(sub)
        engine.stop(TIMEOUT_S)
        return sub, pieces

    sub, pieces = asyncio.run(main())
    assert pieces[-1].finish_reason == "stop"
    assert "".join(p.text for p in pieces).strip() == " ".join(words[:3])
    # The stop string's tokens count, as mlx_lm.server counts them.
    assert sub.completion_tokens == 5


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma2"])
def test_latent_and_soft_capped_families_serve_the_decoders_texts(family, tmp_path):
    from mlx_lm.utils import load

    config = {**(DEEPSEEK_V3 if family == "deepseek_v3" else GEMMA2), "vocab_size": 64}
    model, tokenizer = load(str(save_model_folder(config, tmp_path, seed=2)))
    prompts = [[9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26]]
    expected = [mlx_lm_greedy(model, p, 5) for p in prompts]

    engine = Engine(core(model, 2), ServerMetrics(), max_queue=2)
    results = asyncio.run(serve_all(engine, tokenizer, prompts, 5))
    for pieces, tokens in zip(results, expected):
        eos = [i for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids]
        assert "".join(p.text for p in pieces) == tokenizer.decode(tokens[: (eos or [5])[0]])
