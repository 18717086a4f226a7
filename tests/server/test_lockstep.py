"""Tensor-parallel plans without ranks: a plan survives its int32 encoding, and a follower that
replays rank 0's plans on its own decoder takes the very same steps."""

import asyncio

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.server.engine import Engine  # noqa: E402
from mlx_batched_decode.server.lockstep import Admission, Plan, decode, encode, follow  # noqa: E402
from mlx_batched_decode.server.metrics import ServerMetrics  # noqa: E402
from tests.server.test_engine import TIMEOUT_S, drain, loaded, submission  # noqa: E402, F401


def test_a_plan_survives_its_encoding():
    plan = Plan(
        cancels=[3, 0, 12],
        admits=[Admission([5, 6, 7], 9, 0.7, 0.95, 1234), Admission([8], 1, 0.0, 1.0, 0)],
        step=True,
    )
    assert decode(encode(plan)) == Plan(
        cancels=[3, 0, 12],
        admits=[Admission([5, 6, 7], 9, pytest.approx(0.7), pytest.approx(0.95), 1234),
                Admission([8], 1, 0.0, 1.0, 0)],
        step=True,
    )
    assert decode(encode(Plan(stop=True))) == Plan(stop=True)


class Recorder:
    """Rank 0's side: keeps every plan sent."""

    def __init__(self):
        self.plans = []

    def send(self, plan):
        self.plans.append(decode(encode(plan)))


class Replayer:
    """A follower's side: receives the recorded plans in order."""

    def __init__(self, plans):
        self.plans = iter(plans)

    def receive(self):
        return next(self.plans)


def test_a_follower_replaying_the_plans_takes_the_same_steps(loaded):
    model, tokenizer = loaded
    recorder = Recorder()

    async def main():
        engine = Engine(BatchedDecoder(model), ServerMetrics(), max_batch_size=2, max_queue=4,
                        lockstep=recorder)
        engine.start()
        # Uneven lengths, a stop string, a cancel mid-run: rows join and leave at every turn.
        subs = [submission(tokenizer, [9 + i, 10, 11][: 1 + i % 3], 4 + 3 * i) for i in range(4)]
        long = submission(tokenizer, [30, 31], 10_000)
        for sub in [long, *subs]:
            engine.submit(sub)
        await asyncio.wait_for(long.pieces.get(), TIMEOUT_S)
        engine.cancel(long)
        for sub in subs:
            await drain(sub)
        engine.stop(TIMEOUT_S)
        return engine.decoder

    leader = asyncio.run(main())
    assert recorder.plans[-1].stop and any(p.cancels for p in recorder.plans)
    follower = BatchedDecoder(model)
    follow(follower, Replayer(recorder.plans))
    assert follower.stats.steps == leader.stats.steps
    assert follower.stats.generated_tokens == leader.stats.generated_tokens
    assert follower.stats.prompt_tokens == leader.stats.prompt_tokens
    assert follower.num_active == leader.num_active == 0
