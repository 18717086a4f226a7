"""Tensor-parallel plans without ranks: a plan survives its int32 encoding, and a follower's
runner executing rank 0's plans takes the very same steps."""

import asyncio

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

from mlx_batched_decode.decoding.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from mlx_batched_decode.decoding.engine_core import EngineCore  # noqa: E402
from mlx_batched_decode.decoding.grammar import GrammarSpec  # noqa: E402
from mlx_batched_decode.decoding.plan import Admission, Release, StepPlan  # noqa: E402
from mlx_batched_decode.decoding.runner import ModelRunner  # noqa: E402
from mlx_batched_decode.decoding.sampling import Sampler  # noqa: E402
from mlx_batched_decode.server.engine import Engine  # noqa: E402
from mlx_batched_decode.server.lockstep import decode, encode, follow  # noqa: E402
from mlx_batched_decode.server.metrics import ServerMetrics  # noqa: E402
from mlx_batched_decode.server.text_stream import TextStream  # noqa: E402
from tests.server.test_engine import TIMEOUT_S, drain, loaded, submission  # noqa: E402, F401


def sampler_knobs(sampler):
    """What a follower's sampler is made of: every knob, exactly."""
    return sampler.params, sampler.stream


# Every knob away from its default, at the edges a request may reach.
EVERY_KNOB = dict(
    temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
    repetition_context_size=0, presence_penalty=-1.5, presence_context_size=64,
    frequency_penalty=0.3, frequency_context_size=7, logit_bias={5: -100.0, 9: 2.5, 0: 1e-7},
    xtc_probability=0.5, xtc_threshold=0.15, xtc_special_tokens=(1, 2, 3), logprobs=20,
)


def test_a_plan_survives_its_encoding():
    plan = StepPlan(
        row_changes=[
            Release(0, 2, 17),
            Admission(7, 2, Sampler(0.75, 0.875, 2**63 + 5, stream=3)),
            Release(1, 1, 0),
            Admission(8, 1, Sampler(0.0, 1.0, 0)),
            Admission(9, 0, Sampler(seed=2**64 - 1, stream=15, **EVERY_KNOB),
                      forks=[(11, Sampler(seed=2**64 - 1, stream=16, **EVERY_KNOB)),
                             (12, Sampler(0.5, seed=3, stream=17))],
                      grammar=GrammarSpec("json_schema", '{"type": "object", "title": "é\\u0000"}')),
            Admission(10, 3, Sampler(0.1 + 0.2, 1 / 3, None, **{"logit_bias": {7: 0.1}}),
                      grammar=GrammarSpec("regex", "[a-z]+"), grammar_after=0),
            Admission(13, 5, Sampler(seed=1), grammar=GrammarSpec("json_object"),
                      grammar_after=2**31 - 1),
            Admission(11, 4, Sampler(seed=2**64 - 1, stream=16), source=(0, 37)),
        ],
        uids=[4, 8, 7],
        seq_lens=[17, 0, 0],
        next_tokens=[11, None, None],
        chunks=[[], [5, 6, 7], [9]],
        ending=[False, True, True],
        first_chunks=[(1, 2)],
        reserve_len=3,
        num_draft_tokens=2,
        block_tables=[[3, 4], [0], [1, 2, 9]],
        contexts=[[11, 12], None, []],
        prompt_logprobs=[(1, 5, 8), (2, 0, -1)],
    )
    decoded = decode(encode(plan))
    changes = decoded.row_changes
    decoded.row_changes = plan_changes = plan.row_changes
    assert decoded == plan
    assert [type(c) for c in changes] == [type(c) for c in plan_changes]
    for got, sent in zip(changes, plan_changes):
        if isinstance(sent, Release):
            assert got == sent
        else:
            assert (got.uid, got.row, got.source) == (sent.uid, sent.row, sent.source)
            assert (got.grammar, got.grammar_after) == (sent.grammar, sent.grammar_after)
            assert sampler_knobs(got.sampler) == sampler_knobs(sent.sampler)
            assert [(uid, sampler_knobs(f)) for uid, f in got.forks] == [
                (uid, sampler_knobs(f)) for uid, f in sent.forks
            ]
    assert decode(encode(StepPlan(uids=[0], seq_lens=[0], next_tokens=[1], chunks=[[]],
                                  ending=[False]))).block_tables is None
    assert decode(encode(None)) is None


class Recorder:
    """Rank 0's side: keeps every plan sent, encoded as it travels."""

    def __init__(self):
        self.sent = []

    def send(self, plan):
        self.sent.append(encode(plan))


class Replayer:
    """A follower's side: receives the recorded plans in order, decoded on its own thread
    (where its samplers' keys live)."""

    def __init__(self, sent):
        self.sent = iter(sent)

    def receive(self):
        return decode(next(self.sent))


class RunnerOutputs:
    """What every runner's ``execute`` returns, kept by the side (``"leader"`` or
    ``"follower"``) running now."""

    def __init__(self, monkeypatch):
        self.side, self.of = "leader", {"leader": [], "follower": []}
        real_execute = ModelRunner.execute

        def recording_execute(runner, plan, *args):
            output = real_execute(runner, plan, *args)
            self.of[self.side].append(output)
            return output

        monkeypatch.setattr(ModelRunner, "execute", recording_execute)


@pytest.mark.parametrize("layout", ["slot", "paged"])
def test_a_follower_executing_the_plans_takes_the_same_steps(loaded, layout, monkeypatch):
    model, tokenizer = loaded
    recorder = Recorder()
    outputs = RunnerOutputs(monkeypatch)
    config = EngineConfig(CacheConfig(kv_layout=layout, block_size=4))

    async def main():
        leader = EngineCore(model, EngineConfig(config.cache, SchedulerConfig(max_batch_size=2)))
        engine = Engine(leader, ServerMetrics(), max_queue=8, lockstep=recorder)
        engine.start()
        # Uneven lengths, a stop string, a cancel mid-run, two choices sampling from one
        # prompt: rows join, fork and leave at every turn.
        subs = [submission(tokenizer, [9 + i, 10, 11][: 1 + i % 3], 4 + 3 * i) for i in range(4)]
        # No end-of-sequence token: both choices run past their first token, so the second
        # is admitted as a fork of the first's row.
        no_end = {t: -100.0 for t in tokenizer.eos_token_ids}
        subs.append(submission(tokenizer, [40, 41, 42, 43], 6, n=2, temperature=1.0, seed=5,
                               logit_bias=no_end))
        subs[1].choices[0].stream = TextStream(tokenizer, [tokenizer.decode([20])], 7)
        long = submission(tokenizer, [30, 31], 10_000)
        for sub in [long, *subs]:
            engine.submit([sub])
        await asyncio.wait_for(long.pieces.get(), TIMEOUT_S)
        engine.cancel(long)
        for sub in subs:
            await drain(sub)
        engine.stop(TIMEOUT_S)

    asyncio.run(main())
    plans = [decode(values) for values in recorder.sent]
    assert plans[-1] is None
    changes = [c for p in plans[:-1] for c in p.row_changes]
    assert any(isinstance(c, Release) for c in changes)
    assert any(isinstance(c, Admission) and c.source is not None for c in changes)
    outputs.side = "follower"
    follower = EngineCore(model, config)
    steps = follow(follower.runner, Replayer(recorder.sent))
    assert steps == len(plans) - 1 == len(outputs.of["leader"])
    assert outputs.of["follower"] == outputs.of["leader"]


def test_a_follower_makes_the_same_grammar_masks(tmp_path, monkeypatch):
    """Constrained requests (n choices, a thinking section, drafts) under lockstep: the
    follower's runner, making its matchers from the grammars its plans carry, samples what
    the leader's does."""
    import json

    import mlx_lm.utils

    from mlx_batched_decode.decoding.grammar import GrammarCompiler
    from mlx_batched_decode.tools.model_folder import (
        BYTE_EOS_ID, BYTE_THINK_END_ID, BYTE_VOCAB, save_byte_model_folder,
    )
    from tests.support.mlx_lm_models import SMALL_LLAMA

    model, tokenizer = mlx_lm.utils.load(
        str(save_byte_model_folder(dict(SMALL_LLAMA, vocab_size=BYTE_VOCAB + 10), tmp_path, seed=1))
    )
    compiler = GrammarCompiler(tokenizer, BYTE_VOCAB + 10)
    outputs = RunnerOutputs(monkeypatch)
    config = EngineConfig(CacheConfig(kv_step=16), SchedulerConfig(max_batch_size=6), draft=True)
    leader = EngineCore(model, config, model, grammar_compiler=compiler)
    prompt = tokenizer.encode("<|user|> hi <|assistant|>")
    schema = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    leader.add_choices(prompt, 40, [Sampler(1.0, seed=1, stream=j) for j in range(3)],
                       stop_tokens=[BYTE_EOS_ID], grammar=GrammarSpec("regex", "[a-z]{1,8}"))
    leader.add_request(prompt, 40, stop_tokens=[BYTE_EOS_ID], sampler=Sampler(1.0, seed=2),
                       grammar=schema)
    leader.add_request(prompt, 40, stop_tokens=[BYTE_EOS_ID],
                       sampler=Sampler(1.0, seed=3, logit_bias={BYTE_THINK_END_ID: 3.0}),
                       grammar=GrammarSpec("choice", '["yes", "no"]'), grammar_after=BYTE_THINK_END_ID)
    leader.add_request(prompt, 12, sampler=Sampler(1.0, seed=4))
    sent = []
    while (plan := leader.schedule()) is not None:
        sent.append(encode(plan))
        leader.run(plan)
    sent.append(encode(None))
    outputs.side = "follower"
    follower = EngineCore(model, config, model, grammar_compiler=compiler)
    assert follow(follower.runner, Replayer(sent)) == len(outputs.of["leader"])
    assert outputs.of["follower"] == outputs.of["leader"]
    assert any(o.grammar_ends for o in outputs.of["leader"])
