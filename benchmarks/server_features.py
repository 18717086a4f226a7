"""What a request's fields cost the engine, for ``bench_server.py --features``: the native
server's engine (``EngineCore`` with the server's default scheduler, ``max_batch_size`` raised
to 32) on the server benchmark's model, in process, each case against its plain twin in the same
run, rounds alternating.

- ``knobs``: 32 requests decoding, each with its own seed, ``top_k``, ``min_p``, the three
  penalties and a ``logit_bias``, against 32 greedy requests: the median time of a step in which
  all 32 decode (no prompt fed);
- ``prompt logprobs``: one 1,024-token prompt with its prompt tokens' logprobs (the top 1, as
  lm-evaluation-harness asks) against the same prompt without: time to its first token. Its
  floor (``floor_s``): the same steps with the model's last layer and head run over every
  prompt row and nothing after the head. A plain prompt's chunks but the last run neither
  (their keys and values are all they write), so that work is what the logprobs cannot avoid;
  the log-softmax and the top-1 are what they add to it;
- ``n``: ``n: 4`` on a 1,024-token prompt against ``n: 1``: time until every choice has its
  first token, and the prompt tokens fed (``StepResult.prompt_tokens``, which the server's
  ``mbd_prompt_tokens_total`` counts).

The model's matmuls bound every figure (MLX's Linux wheel multiplies through reference BLAS):
the head over a prompt's rows is what prompt logprobs add, the sampling pass what the knobs add.
With ``--vocab`` the same model gets a larger vocabulary (the head and the sampling pass grow
with it).
"""

from __future__ import annotations

import random
import statistics
import time
from contextlib import contextmanager

import mlx.core as mx

from mlx_batched_decode.decoding import runner
from mlx_batched_decode.decoding.config import CacheConfig, EngineConfig, SchedulerConfig
from mlx_batched_decode.decoding.engine_core import EngineCore
from mlx_batched_decode.decoding.sampling import Sampler
from mlx_batched_decode.tools.random_model import random_model

BATCH = 32
DECODE_PROMPT = 64
DECODE_STEPS = 24
LONG_PROMPT = 1024
CHOICES = 4


def _engine(model) -> EngineCore:
    scheduler = SchedulerConfig(max_step_tokens=128, max_batch_size=BATCH)
    return EngineCore(model, EngineConfig(CacheConfig(), scheduler))


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def _knobs(i: int, vocab: int) -> Sampler:
    """Request ``i``'s own seed and knobs, every one mlx_lm.server serves but top-p."""
    return Sampler(
        0.7 + 0.02 * i, seed=1000 + i, top_k=20 + i, min_p=0.02,
        repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2,
        logit_bias={(7 * i + j) % vocab: 1.5 - j for j in range(4)},
    )


def decode_step_time(model, vocab: int, knobs: bool, seed: int) -> float:
    """Median seconds of the steps in which all ``BATCH`` requests decode."""
    rng = random.Random(seed)
    core = _engine(model)
    for i in range(BATCH):
        sampler = _knobs(i, vocab) if knobs else None
        core.add_request(_prompt(rng, DECODE_PROMPT, vocab), DECODE_STEPS + 8, sampler=sampler)
    times = []
    while core.has_requests and len(times) < DECODE_STEPS:
        plan = core.schedule()
        start = time.perf_counter()
        core.run(plan)
        if not plan.fed_prompts and len(plan.uids) == BATCH:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def first_tokens_time(model, vocab: int, n: int, logprobs: bool, seed: int) -> tuple[float, int]:
    """Seconds from adding a ``LONG_PROMPT``-token request of ``n`` choices until every choice
    has a token, and the prompt tokens fed meanwhile."""
    rng = random.Random(seed)
    core = _engine(model)
    prompt = _prompt(rng, LONG_PROMPT, vocab)
    samplers = [Sampler(1.0, seed=seed, stream=j) for j in range(n)]
    start = time.perf_counter()
    uids = set(core.add_choices(prompt, 4, samplers, prompt_logprobs=1 if logprobs else None))
    fed = 0
    while uids:
        result = core.run(core.schedule())
        fed += result.prompt_tokens - result.prefix_hit_tokens
        uids -= set(result.tokens)
    return time.perf_counter() - start, fed


@contextmanager
def _head_only():
    """While active, the rows of a prompt asking for its logprobs get their logits and
    nothing after them (the floor of ``prompt logprobs``)."""
    real = runner.prompt_logprobs
    runner.prompt_logprobs = lambda logits, targets, k: (logits[:, 0], None, None)
    try:
        yield
    finally:
        runner.prompt_logprobs = real


def _floor(model, vocab: int, seed: int) -> float:
    with _head_only():
        return first_tokens_time(model, vocab, 1, True, seed)[0]


def run(rounds: int, vocab: int, seed: int) -> list[dict]:
    """Each case and its plain twin, ``rounds`` times alternating: one row per case."""
    from bench_server import CONFIG

    config = dict(CONFIG, vocab_size=vocab)
    model = random_model(config, seed=seed)
    mx.eval(model.parameters())
    cases = {
        "knobs": (
            lambda r: decode_step_time(model, vocab, True, seed + r),
            lambda r: decode_step_time(model, vocab, False, seed + r),
        ),
        "prompt logprobs": (
            lambda r: first_tokens_time(model, vocab, 1, True, seed + r)[0],
            lambda r: first_tokens_time(model, vocab, 1, False, seed + r)[0],
        ),
        "n": (
            lambda r: first_tokens_time(model, vocab, CHOICES, False, seed + r)[0],
            lambda r: first_tokens_time(model, vocab, 1, False, seed + r)[0],
        ),
    }
    # One warm-up of each: graph set-up and first allocations.
    for case, plain in cases.values():
        case(rounds), plain(rounds)
    rows = []
    for name, (case, plain) in cases.items():
        with_, without = [], []
        for r in range(rounds):
            pair = [(with_, case), (without, plain)]
            for times, measure in pair if r % 2 == 0 else pair[::-1]:
                times.append(measure(r))
        row = {"case": name, "vocab": vocab, "rounds": rounds,
               "with_s": statistics.median(with_), "without_s": statistics.median(without)}
        row["ratio"] = row["with_s"] / row["without_s"]
        rows.append(row)
    floors = [_floor(model, vocab, seed + r) for r in range(rounds)]
    rows[1]["floor_s"] = statistics.median(floors)
    rows[1]["floor_ratio"] = rows[1]["floor_s"] / rows[1]["without_s"]
    _, fed_n = first_tokens_time(model, vocab, CHOICES, False, seed)
    _, fed_1 = first_tokens_time(model, vocab, 1, False, seed)
    rows[-1]["prompt_tokens_fed"] = fed_n
    rows[-1]["prompt_tokens_fed_n1"] = fed_1
    return rows
