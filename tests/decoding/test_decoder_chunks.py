"""BatchedDecoder's packed steps: prompts fed in chunks beside the running requests' decode
tokens, up to ``max_step_tokens`` a step. Greedy tokens equal mlx-lm's single-request decode
however the prompts are cut, on the zero-copy path and on the seed path (the baseline) alike."""

import pytest

pytest.importorskip("mlx_lm")

from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import LLAMA, mlx_lm_greedy, random_prompts  # noqa: E402

PROMPT_LENS = [40, 3, 17, 1, 29]
MAX_TOKENS = [6, 9, 4, 7, 5]


@pytest.fixture(scope="module")
def model():
    return random_model(LLAMA, seed=1)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENS, seed=7)


@pytest.fixture(scope="module")
def references(model, prompts):
    return [mlx_lm_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]


def drive(decoder, prompts, budgets=MAX_TOKENS, joins=None):
    """Adds prompt i before step ``joins[i]`` (all at step 0 by default), steps until every
    request is done; returns each prompt's tokens and the step counts (rows) seen."""
    joins = joins or [0] * len(prompts)
    produced, index, step = [[] for _ in prompts], {}, 0
    while len(index) < len(prompts) or decoder.num_active:
        for i, at in enumerate(joins):
            if at == step:
                index[decoder.add_request(prompts[i], budgets[i])] = i
        if decoder.num_active:
            for uid, tokens in decoder.step().tokens.items():
                produced[index[uid]] += tokens
        step += 1
    return produced


@pytest.mark.parametrize("path", ["slot", "seed"])
@pytest.mark.parametrize("budget", range(1, 18))
def test_a_prompt_cut_at_every_position_of_a_block(model, prompts, references, budget, path):
    """Budgets 1..17 cut the 40-token prompt, beside four others, at every offset of a
    16-position block (budgets below the decode rows included: those rows run anyway)."""
    decoder = BatchedDecoder(model, attention=path, kv_step=16, max_step_tokens=budget)
    assert drive(decoder, prompts) == references


@pytest.mark.parametrize("path", ["slot", "seed"])
def test_prompts_ending_exactly_at_the_budget(model, prompts, references, path):
    # One request at a time: add_request computes nothing, every prompt's last chunk ends
    # exactly at the budget of its length, and its first token comes out of that step.
    for i, prompt in enumerate(prompts):
        decoder = BatchedDecoder(model, attention=path, kv_step=16, max_step_tokens=len(prompt))
        uid = decoder.add_request(prompt, MAX_TOKENS[i])
        assert decoder.stats.prompt_tokens == 0 and decoder.stats.steps == 0
        result = decoder.step()
        assert result.tokens == {uid: references[i][:1]}


@pytest.mark.parametrize("path", ["slot", "seed"])
def test_requests_join_and_leave_in_every_step(model, prompts, references, path):
    decoder = BatchedDecoder(model, attention=path, kv_step=16, max_step_tokens=7)
    assert drive(decoder, prompts, joins=[0, 1, 2, 3, 4]) == references
    assert decoder.num_active == 0


def test_decode_rows_always_run_and_prompts_wait_for_budget(model, prompts, references):
    """A budget of 1 with requests decoding: each step carries every decode row (past the
    budget) and no chunk, so a new prompt waits until the running requests are done."""
    decoder = BatchedDecoder(model, kv_step=16, max_step_tokens=1)
    first = [decoder.add_request(p, n) for p, n in zip(prompts[1:4:2], MAX_TOKENS[1:4:2])]
    while any(decoder.stats.requests[u].first_token is None for u in first):
        decoder.step()
    late = decoder.add_request(prompts[2], MAX_TOKENS[2])
    while decoder.num_active > 1:
        result = decoder.step()
        still_running = {u for u in first if decoder.stats.requests[u].finished is None}
        assert set(result.tokens) == still_running | set(result.finished)
        assert decoder.stats.requests[late].first_token is None
    produced = []
    while decoder.num_active:
        produced += decoder.step().tokens.get(late, [])
    assert produced == references[2]


@pytest.mark.parametrize("path", ["slot", "seed"])
def test_cancel_of_a_request_mid_prompt(model, prompts, references, path):
    decoder = BatchedDecoder(model, attention=path, kv_step=16, max_step_tokens=8)
    long_uid = decoder.add_request(prompts[0], MAX_TOKENS[0])
    other = decoder.add_request(prompts[4], MAX_TOKENS[4])
    decoder.step()  # 8 of the 40 prompt tokens
    assert decoder.cancel(long_uid) and decoder.num_active == 1
    produced = []
    while decoder.num_active:
        produced += decoder.step().tokens.get(other, [])
    assert produced == references[4]
    assert decoder.stats.requests[long_uid].first_token is None
