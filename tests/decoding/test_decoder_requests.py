"""A serving loop's view of BatchedDecoder: ``cancel`` of a queued or running request (slot,
paged and speculative), after which the other requests' greedy tokens still equal mlx-lm's
single-request decode, ``stats.requests``' per-request timing against the steps' own clock, and
a sampler per request."""

import time

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.decoding.sampling import Sampler, sample_rows  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import LLAMA, mlx_lm_greedy, random_prompts  # noqa: E402

PROMPT_LENS = [9, 30, 17, 4, 23]
MAX_TOKENS = [8, 10, 6, 9, 7]


@pytest.fixture(scope="module")
def model():
    return random_model(LLAMA, seed=1)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENS, seed=3)


@pytest.fixture(scope="module")
def references(model, prompts):
    return [mlx_lm_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]


def run(decoder, prompts, cancels):
    """Adds every prompt, steps until all are done; ``cancels[step]``: the prompt indices to
    cancel before that step. Returns each prompt's tokens and its uid."""
    uids = [decoder.add_request(p, n) for p, n in zip(prompts, MAX_TOKENS)]
    index = {uid: i for i, uid in enumerate(uids)}
    produced = [[] for _ in prompts]
    step = 0
    while decoder.num_active or decoder.num_waiting:
        for i in cancels.get(step, []):
            assert decoder.cancel(uids[i])
        if not (decoder.num_active or decoder.num_waiting):
            break
        for uid, tokens in decoder.step().tokens.items():
            produced[index[uid]] += tokens
        step += 1
    return produced, uids


@pytest.mark.parametrize("layout", ["slot", "paged", "speculative"])
def test_cancelled_requests_stop_and_the_others_decode_unchanged(model, prompts, references,
                                                                 layout):
    kwargs = {
        "slot": dict(kv_step=16),
        "paged": dict(kv_layout="paged", block_size=8),
        "speculative": dict(draft_model=model, num_draft_tokens=2, kv_step=16),
    }[layout]
    decoder = BatchedDecoder(model, **kwargs)
    # Request 1 (a middle row) before its first step, 3 (the last row) and 0 (the first) mid-way.
    produced, uids = run(decoder, prompts, {0: [1], 2: [3, 0]})
    assert produced[1] == []
    for i in (0, 3):
        assert 0 < len(produced[i]) < MAX_TOKENS[i]
        assert produced[i] == references[i][: len(produced[i])]
    assert [produced[i] for i in (2, 4)] == [references[i] for i in (2, 4)]
    for i, uid in enumerate(uids):
        timing = decoder.stats.requests[uid]
        assert timing.cancelled == (i in (0, 1, 3)) and timing.finished is not None
        assert not decoder.cancel(uid)
    if layout == "paged":
        assert decoder.stats.blocks_in_use == decoder.paged_cache.blocks_in_use == 0


def test_cancel_of_a_request_waiting_for_blocks_lets_the_rest_in(model, prompts, references):
    # 6 blocks of 8: requests 0 and 1 (2 + 5 blocks) cannot both fit, so 1 waits behind 0.
    decoder = BatchedDecoder(model, kv_layout="paged", block_size=8, max_kv_blocks=6)
    first = decoder.add_request(prompts[0], MAX_TOKENS[0])
    queued = decoder.add_request(prompts[1], MAX_TOKENS[1])
    third = decoder.add_request(prompts[2], MAX_TOKENS[2])
    assert decoder.num_active == 1 and decoder.num_waiting == 2
    held = decoder.paged_cache.blocks_in_use
    assert decoder.cancel(queued)
    assert decoder.num_waiting == 1 and decoder.paged_cache.blocks_in_use == held
    produced = {first: [], third: []}
    while decoder.num_active or decoder.num_waiting:
        for uid, tokens in decoder.step().tokens.items():
            produced[uid] += tokens
    assert [produced[first], produced[third]] == [references[0], references[2]]
    assert decoder.stats.requests[queued].first_token is None
    assert not decoder.cancel(12345)


def test_request_timing_follows_the_steps(model, prompts):
    decoder = BatchedDecoder(model, kv_step=16)
    before = time.perf_counter()
    uids = [decoder.add_request(p, n) for p, n in zip(prompts[:3], MAX_TOKENS[:3])]
    ends, emitted = [], {uid: [] for uid in uids}
    while decoder.num_active:
        result = decoder.step()
        ends.append(time.perf_counter())
        for uid, tokens in result.tokens.items():
            emitted[uid].append(len(ends) - 1)
    for uid, n in zip(uids, MAX_TOKENS[:3]):
        timing = decoder.stats.requests[uid]
        steps = emitted[uid]
        assert before <= timing.arrived <= timing.first_token <= ends[steps[0]]
        # Each stamp lies inside the step that emitted the tokens: after the previous step's end.
        assert steps[0] == 0 or timing.first_token > ends[steps[0] - 1]
        assert timing.time_to_first_token == timing.first_token - timing.arrived
        assert timing.tokens == n and len(timing.gaps) == len(steps) - 1
        assert all(g > 0 for g in timing.gaps)
        assert timing.last_token == timing.finished <= ends[steps[-1]]
        assert sum(timing.gaps) == pytest.approx(timing.last_token - timing.first_token)
        assert not timing.cancelled


class RowSpy(Sampler):
    """Greedy, counting the rows it chooses for (or, with ``token``, always that token)."""

    def __init__(self, token=None):
        super().__init__()
        self.token, self.rows = token, 0

    def __call__(self, logits):
        self.rows += logits.shape[0]
        if self.token is None:
            return super().__call__(logits)
        return mx.full((logits.shape[0],), self.token, dtype=mx.int32)


def test_sample_rows_puts_each_samplers_rows_back_in_place():
    logits = mx.random.normal((5, 11), key=mx.random.key(0))
    greedy, sevens = RowSpy(), RowSpy(token=7)
    chosen = sample_rows([sevens, greedy, sevens, greedy, greedy], logits).tokens
    argmax = mx.argmax(logits, axis=-1).tolist()
    assert chosen.tolist() == [7, argmax[1], 7, argmax[3], argmax[4]]
    assert (greedy.rows, sevens.rows) == (3, 2)


@pytest.mark.parametrize("draft", [False, True])
def test_requests_bring_their_own_samplers(model, prompts, references, draft):
    """A request with its own sampler (here: always token 7) gets its tokens from it alone,
    draft proposals too; the others keep the step's greedy sampler and mlx-lm's tokens."""
    decoder = BatchedDecoder(model, draft_model=model if draft else None, max_step_tokens=16)
    own = RowSpy(token=7)
    uids = [
        decoder.add_request(p, n, sampler=own if i == 1 else None)
        for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS))
    ]
    produced = {uid: [] for uid in uids}
    while decoder.num_active:
        for uid, tokens in decoder.step().tokens.items():
            produced[uid] += tokens
    assert produced[uids[1]] == [7] * MAX_TOKENS[1]
    assert [produced[u] for i, u in enumerate(uids) if i != 1] == references[:1] + references[2:]
    assert own.rows >= MAX_TOKENS[1]


@pytest.mark.parametrize("draft", [False, True])
def test_a_seeded_request_samples_the_same_alone_or_in_a_batch(model, prompts, draft):
    """Its own random stream: a request sampling at temperature 1 from seed 5 gets the same
    tokens alone and beside other requests with other knobs (greedy, other seeds, top-p),
    however the steps cut its prompt."""

    def seeded(decoder, others):
        uids = [decoder.add_request(p, 12, sampler=s) for p, s in others]
        own = decoder.add_request(prompts[1], 12, sampler=Sampler(1.0, 1.0, 5))
        produced = {uid: [] for uid in [*uids, own]}
        while decoder.num_active:
            for uid, tokens in decoder.step().tokens.items():
                produced[uid] += tokens
        return produced[own]

    kwargs = dict(draft_model=model, num_draft_tokens=2) if draft else {}
    alone = seeded(BatchedDecoder(model, **kwargs), [])
    others = [(prompts[0], None), (prompts[2], Sampler(0.8, 0.9, 3)), (prompts[3], Sampler(2.0))]
    beside = seeded(BatchedDecoder(model, max_step_tokens=16, **kwargs), others)
    assert len(alone) == 12 and beside == alone
    assert seeded(BatchedDecoder(model, **kwargs), []) == alone


@pytest.mark.parametrize("attention", ["slot", "seed"])
def test_a_prefilled_request_joins_after_others_left(model, prompts, references, attention):
    """A request loaded with its context right after a step that ended another: the row that
    moves into the freed one keeps its keys/values, the new request takes the next row, and
    every request's greedy tokens stay mlx-lm's."""
    from tests.support.mlx_lm_prefill import prefill

    decoder = BatchedDecoder(model, attention=attention, kv_step=16)
    first = decoder.add_prefilled_request(prompts[0], 1, prefill(model, prompts[0][:-1], 8))
    second = decoder.add_prefilled_request(
        prompts[1], MAX_TOKENS[1], prefill(model, prompts[1][:-1], 8)
    )
    produced = {first: [], second: []}
    result = decoder.step()
    assert result.finished == [first] and decoder.num_active == 1
    for uid, tokens in result.tokens.items():
        produced[uid] += tokens
    third = decoder.add_prefilled_request(
        prompts[2], MAX_TOKENS[2], prefill(model, prompts[2][:-1], 8)
    )
    produced[third] = []
    while decoder.num_active:
        for uid, tokens in decoder.step().tokens.items():
            produced[uid] += tokens
    assert produced[first] == references[0][:1]
    assert produced[second] == references[1] and produced[third] == references[2]
