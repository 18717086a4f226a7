"""The engine core's per-request outputs beyond tokens, against mlx-lm and the model itself:

- n choices of one prompt (``EngineCore.add_choices``): the prompt fed once, each choice's
  tokens equal to the same sampler's alone (slot, paged with shared blocks, seed layouts);
- prompt logprobs out of the chunks the request runs (``prompt_logprobs``), equal to a direct
  forward pass of the model, also over chunked prompts and with ``max_tokens`` 0;
- penalties and logit bias over each request's own context, and the sampled tokens' logprobs,
  equal to mlx-lm's ``generate_step`` with its logits processors, with and without a draft.
"""

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from mlx_lm.sample_utils import make_logits_processors  # noqa: E402

from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.decoding.request import FinishReason  # noqa: E402
from mlx_batched_decode.decoding.sampling import Sampler  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import LLAMA, direct_logprobs, random_prompts  # noqa: E402

LAYOUTS = {
    "slot": dict(kv_step=16),
    "paged": dict(kv_layout="paged", block_size=8),
    "seed": dict(attention="seed", kv_step=16),
}


@pytest.fixture(scope="module")
def model():
    return random_model(LLAMA, seed=1)


def drain(decoder):
    """Steps until every request ended: each uid's tokens, logprobs, prompt logprobs and
    finish reason, and the prompt tokens fed."""
    tokens, logprobs, prompt, reasons, fed = {}, {}, {}, {}, 0
    while decoder.core.has_requests:
        result = decoder.step()
        fed += result.prompt_tokens - result.prefix_hit_tokens
        for uid, new in result.tokens.items():
            tokens.setdefault(uid, []).extend(new)
        for uid, entries in result.logprobs.items():
            assert len(entries) == len(result.tokens[uid])
            logprobs.setdefault(uid, []).extend(entries)
        for uid, entries in result.prompt_logprobs.items():
            prompt.setdefault(uid, []).extend(entries)
        reasons.update(result.reasons)
    return tokens, logprobs, prompt, reasons, fed


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_choices_feed_the_prompt_once_and_each_samples_as_alone(model, layout):
    prompt = random_prompts([21], seed=4)[0]
    knobs = [dict(temperature=0.0), dict(temperature=1.0, seed=7, stream=1),
             dict(temperature=0.8, top_k=5, seed=7, stream=2), dict(temperature=1.0, seed=9)]
    decoder = BatchedDecoder(model, max_step_tokens=8, **LAYOUTS[layout])
    uids = decoder.add_choices(prompt, 9, [Sampler(**k) for k in knobs])
    decoder.add_request(random_prompts([5], seed=8)[0], 6)
    together, _, _, _, fed = drain(decoder)
    assert fed == len(prompt) + 5
    for uid, k in zip(uids, knobs):
        alone = BatchedDecoder(model, max_step_tokens=8, **LAYOUTS[layout])
        alone.add_request(prompt, 9, sampler=Sampler(**k))
        assert drain(alone)[0][0] == together[uid]


def test_paged_choices_share_the_prompt_blocks(model):
    prompt = random_prompts([40], seed=5)[0]
    decoder = BatchedDecoder(model, max_step_tokens=64, kv_layout="paged", block_size=8,
                             prefix_sharing=False)
    decoder.add_choices(prompt, 4, [Sampler(1.0, seed=s) for s in range(4)])
    decoder.step()  # the prompt, and the choices' first tokens
    decoder.step()  # every choice writes its first token: a block of its own past the prompt's
    # 40 prompt positions are 5 full blocks, shared; each choice then holds one block of its own.
    assert decoder.core.snapshot().kv_in_use == 5 + 4


def test_choices_hold_rows_and_a_cancelled_choice_frees_its_own(model):
    decoder = BatchedDecoder(model, max_step_tokens=8, max_batch_size=3, kv_step=16)
    uids = decoder.add_choices(random_prompts([20], seed=6)[0], 5, [Sampler()] * 3)
    later = decoder.add_request(random_prompts([4], seed=7)[0], 5)
    with pytest.raises(ValueError, match="n must be"):
        decoder.core.check_request(4, 5, n=4)
    result = decoder.step()
    # The three rows are held for the choices: the later request waits.
    assert result.snapshot.running == 1 and result.snapshot.waiting == 1
    assert decoder.core.finish(uids[2]) is not None
    tokens, _, _, reasons, _ = drain(decoder)
    assert uids[2] not in tokens and later in tokens
    assert [len(tokens[u]) for u in uids[:2]] == [5, 5]
    assert reasons[later] is FinishReason.LENGTH


@pytest.mark.parametrize("layout", ["slot", "paged"])
@pytest.mark.parametrize("max_tokens", [0, 3])
def test_prompt_logprobs_equal_a_direct_forward_pass(model, layout, max_tokens):
    prompt = random_prompts([29], seed=9)[0]
    decoder = BatchedDecoder(model, max_step_tokens=8, **LAYOUTS[layout])
    # The same prompt cached first: a request asking for its logprobs computes every block.
    decoder.add_request(prompt, 2)
    drain(decoder)
    uid = decoder.add_request(prompt, max_tokens, prompt_logprobs=3)
    other = decoder.add_request(random_prompts([11], seed=2)[0], 4)
    tokens, _, prompt_lp, reasons, _ = drain(decoder)
    want = direct_logprobs(model, prompt)
    entries = prompt_lp[uid]
    assert [e.token for e in entries] == prompt[1:] and other not in prompt_lp
    for p, entry in enumerate(entries, start=1):
        assert abs(entry.logprob - want[p - 1, prompt[p]]) < 1e-3
        assert [t for t, _ in entry.top] == list(np.argsort(-want[p - 1])[:3])
        assert np.allclose([v for _, v in entry.top], np.sort(want[p - 1])[::-1][:3], atol=1e-3)
    assert reasons[uid] is FinishReason.LENGTH
    assert len(tokens.get(uid, [])) == max_tokens


KNOBS = [
    dict(repetition_penalty=1.8, repetition_context_size=6),
    dict(presence_penalty=2.0, frequency_penalty=1.0, frequency_context_size=12),
    dict(logit_bias={3: 4.0, 17: -2.5}, repetition_penalty=1.3),
    dict(),
]


def mlx_lm_reference(model, prompt, max_tokens, knobs):
    """mlx-lm's ``generate_step`` with its logits processors: tokens and each one's logprobs."""
    from mlx_lm.generate import generate_step

    processors = make_logits_processors(
        knobs.get("logit_bias"), knobs.get("repetition_penalty"),
        knobs.get("repetition_context_size", 20), knobs.get("presence_penalty"),
        knobs.get("presence_context_size", 20), knobs.get("frequency_penalty"),
        knobs.get("frequency_context_size", 20),
    )
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                          logits_processors=processors)
    return [(token, np.array(lp.astype(mx.float32))) for token, lp in steps]


@pytest.mark.parametrize("draft", [False, True])
def test_penalties_and_logprobs_equal_mlx_lm(model, draft):
    prompts = random_prompts([13, 6, 19, 9], seed=11)
    extra = {}
    if draft:
        extra = dict(draft_model=random_model(LLAMA, seed=2), num_draft_tokens=2)
    decoder = BatchedDecoder(model, max_step_tokens=16, kv_step=16, **extra)
    uids = [
        decoder.add_request(p, 10, sampler=Sampler(logprobs=4, **k))
        for p, k in zip(prompts, KNOBS)
    ]
    tokens, logprobs, _, _, _ = drain(decoder)
    for uid, prompt, knobs in zip(uids, prompts, KNOBS):
        want = mlx_lm_reference(model, prompt, 10, knobs)
        assert tokens[uid] == [t for t, _ in want]
        for entry, (token, lp) in zip(logprobs[uid], want):
            assert entry.token == token and abs(entry.logprob - lp[token]) < 1e-3
            assert [t for t, _ in entry.top] == list(np.argsort(-lp)[:4])
