"""The batched sampler: every row in one pass with its own knobs, a seeded request's tokens from
its own random stream (the same alone or in any batch), temperature sampling that follows the
softmax, and requests with other knobs side by side in one decoder step."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest

import mlx_batched_decode.decoding.sampling as sampling
from mlx_batched_decode.decoding.sampling import Sampler, prompt_logprobs, sample_rows
from mlx_batched_decode.decoding.sampling_params import WHOLE_HISTORY, SamplingParams
from mlx_lm.sample_utils import (
    apply_min_p, apply_top_k, apply_top_p, apply_xtc, make_logits_processors,
)

VOCAB = 23


def logits_of(rows, seed=0):
    return mx.random.normal((rows, VOCAB), key=mx.random.key(seed)) * 2


def test_seeded_rows_draw_from_their_own_stream_in_any_batch():
    """Row r of a batch of seeded samplers gets the token its sampler alone gets."""
    logits = logits_of(6)
    knobs = [(1.0, 1.0, 11), (0.7, 0.9, 12), (1.3, 1.0, 13), (0.0, 1.0, None), (1.0, 0.5, 14),
             (2.0, 1.0, 15)]
    together = [Sampler(*k) for k in knobs]
    alone = [Sampler(*k) for k in knobs]
    for step in range(5):
        batch = sample_rows(together, logits).tokens.tolist()
        single = [s(logits[r : r + 1]).item() for r, s in enumerate(alone)]
        assert batch == single, step
    # Another order of the same requests: the same tokens, row by row.
    reordered = [Sampler(*k) for k in knobs[::-1]]
    again = [Sampler(*k) for k in knobs]
    assert (sample_rows(reordered, logits[::-1]).tokens.tolist()[::-1]
            == sample_rows(again, logits).tokens.tolist())


def test_one_batched_pass_for_many_seeded_requests(monkeypatch):
    calls = []
    real = sampling._choose

    def counting(samplers, *arrays):
        calls.append(len(samplers))
        return real(samplers, *arrays)

    monkeypatch.setattr(sampling, "_choose", counting)
    samplers = [Sampler(1.0, 0.95, seed) for seed in range(32)]
    sample_rows(samplers, logits_of(32))
    assert calls == [32]


def test_greedy_rows_and_a_tiny_top_p_take_the_argmax():
    logits = logits_of(4, seed=3)
    argmax = mx.argmax(logits, axis=-1).tolist()
    samplers = [Sampler(), Sampler(5.0, 1e-6, 1), Sampler(), Sampler(5.0, 1e-6)]
    assert sample_rows(samplers, logits).tokens.tolist() == argmax


def test_streams_of_one_seed_differ_and_repeat():
    logits = mx.zeros((1, VOCAB))

    def tokens(stream):
        sampler = Sampler(1.0, 1.0, 7, stream)
        return [sampler(logits).item() for _ in range(20)]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.6, 1.0), (1.0, 0.7)])
def test_samples_follow_the_tempered_truncated_softmax(temperature, top_p):
    """4,000 rows of one distribution, each its own seeded sampler: the counts match the
    float64 reference within 5 standard deviations per token."""
    rows = 4000
    base = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.0, 0.7])
    logits = mx.array(np.tile(base, (rows, 1)), dtype=mx.float32)
    samplers = [Sampler(temperature, top_p, seed) for seed in range(rows)]
    counts = np.bincount(np.array(sample_rows(samplers, logits).tokens), minlength=len(base))
    probs = np.exp(base / temperature - np.max(base / temperature))
    probs /= probs.sum()
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    kept = np.zeros_like(probs, dtype=bool)
    kept[order[mass_before < top_p]] = True
    expected = np.where(kept, probs, 0.0)
    expected /= expected.sum()
    assert counts[~kept].sum() == 0
    for token in np.flatnonzero(kept):
        sd = math.sqrt(rows * expected[token] * (1 - expected[token]))
        assert abs(counts[token] - rows * expected[token]) < 5 * sd + 1, token


# --- Every knob of mlx_lm.server, against mlx-lm's own processors and samplers and float64.


def contexts_of(histories):
    """int32 ``[R, C]``: each history's tokens, left-padded with -1."""
    width = max(len(h) for h in histories)
    return mx.array([[-1] * (width - len(h)) + list(h) for h in histories], dtype=mx.int32)


def mlx_lm_processed(params, logits_row, history):
    """float32 ``[1, V]``: mlx-lm's ``make_logits_processors`` applied to one row."""
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty,
        presence_context_size=params.presence_context_size,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=params.frequency_context_size,
    )
    logits = logits_row.astype(mx.float32)
    for processor in processors if history else []:
        logits = processor(mx.array(history, dtype=mx.int32), logits)
    return logits


def log_softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


PROCESSOR_KNOBS = [
    dict(logit_bias={3: 4.0, 17: -2.5}),
    dict(repetition_penalty=3.0, repetition_context_size=5),
    dict(presence_penalty=4.0, presence_context_size=0, frequency_penalty=1.5,
         frequency_context_size=3),
    dict(logit_bias={5: 1.0}, repetition_penalty=1.5, repetition_context_size=8,
         presence_penalty=2.0, presence_context_size=4, frequency_penalty=0.7,
         frequency_context_size=12),
    dict(),
    dict(frequency_penalty=2.0, frequency_context_size=20),
    dict(repetition_penalty=0.5, repetition_context_size=0, presence_penalty=-1.0,
         presence_context_size=6),
]


def penalized_batch(vocab, seed=0):
    """Logits with a few close favourites per row and histories (lengths 3 to 30) that
    repeat those favourites: every penalty and window changes the processed logits."""
    rows = len(PROCESSOR_KNOBS)
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 2
    histories = []
    for r in range(rows):
        hot = np.argsort(-logits[r])[:6]
        logits[r, hot] += 6.0
        length = [3, 30, 17, 9, 25, 11, 22][r]
        histories.append(rng.choice(np.concatenate([hot, rng.integers(0, vocab, 4)]), length).tolist())
    return mx.array(logits), histories


@pytest.mark.parametrize("vocab", [1000, 32000])
def test_greedy_rows_take_the_argmax_of_mlx_lms_processed_logits(vocab):
    logits, histories = penalized_batch(vocab)
    samplers = [Sampler(logprobs=3, **knobs) for knobs in PROCESSOR_KNOBS]
    sampled = sample_rows(samplers, logits, contexts_of(histories))
    for r, sampler in enumerate(samplers):
        reference = mlx_lm_processed(sampler.params, logits[r : r + 1], histories[r])
        assert sampled.tokens[r].item() == mx.argmax(reference, axis=-1).item(), r
        expected = log_softmax64(reference)[0]
        assert abs(sampled.logprobs[r].item() - expected[sampled.tokens[r].item()]) < 1e-5, r
        np.testing.assert_allclose(np.array(sampled.top_logprobs[r]), np.sort(expected)[::-1][:3],
                                   atol=1e-5)
    # The penalties changed some argmax: the comparison above is not the raw argmax's.
    assert sampled.tokens.tolist() != mx.argmax(logits, axis=-1).tolist()


def test_penalties_read_each_row_context_window():
    """Every reported logprob of every row equals the float64 log-softmax of mlx-lm's
    processed logits: each penalty's window, distinct tokens and repeats."""
    logits, histories = penalized_batch(1000, seed=1)
    samplers = [Sampler(logprobs=20, **knobs) for knobs in PROCESSOR_KNOBS]
    sampled = sample_rows(samplers, logits, contexts_of(histories))
    for r, sampler in enumerate(samplers):
        expected = log_softmax64(mlx_lm_processed(sampler.params, logits[r : r + 1], histories[r]))[0]
        ids = np.array(sampled.top_ids[r])
        np.testing.assert_allclose(np.array(sampled.top_logprobs[r]), expected[ids], atol=1e-5)
        assert set(ids.tolist()) == set(np.argsort(-expected)[:20].tolist()), r


def test_penalties_without_contexts_and_unknown_token_ids_raise():
    logits = logits_of(2)
    with pytest.raises(ValueError, match="contexts"):
        sample_rows([Sampler(), Sampler(presence_penalty=1.0)], logits)
    with pytest.raises(ValueError, match="logit_bias"):
        sample_rows([Sampler(logit_bias={VOCAB: 1.0})], logits[:1])
    with pytest.raises(ValueError, match="xtc_special_tokens"):
        sample_rows([Sampler(1.0, xtc_probability=0.5, xtc_special_tokens=(VOCAB + 3,))], logits[:1])


def test_top_k_1_and_min_p_1_take_the_greedy_token():
    logits, histories = penalized_batch(1000, seed=2)
    contexts = contexts_of(histories)
    greedy = sample_rows([Sampler(**k) for k in PROCESSOR_KNOBS], logits, contexts).tokens.tolist()
    for knob in (dict(top_k=1), dict(min_p=1.0)):
        for seed in range(5):
            samplers = [Sampler(1.0, seed=seed, **knob, **k) for k in PROCESSOR_KNOBS]
            assert sample_rows(samplers, logits, contexts).tokens.tolist() == greedy, (knob, seed)


TRUNCATIONS = [
    dict(top_p=0.9), dict(top_p=0.3), dict(min_p=0.05), dict(min_p=0.3), dict(top_k=7),
    dict(top_k=40), dict(xtc_probability=1.0, xtc_threshold=0.05),
    dict(xtc_probability=1.0, xtc_threshold=0.02, xtc_special_tokens=(0, 1, 2)),
    dict(top_p=0.95, min_p=0.02, top_k=30),
    dict(top_p=0.8, min_p=0.1, xtc_probability=1.0, xtc_threshold=0.03, top_k=5),
    dict(),
]


def assert_truncations_match_mlx_lm(truncations, logits):
    """Row r of ``logits`` under ``truncations[r]``, all in one ``_truncate``: the tokens left
    are the ones mlx-lm's ``apply_*`` chain leaves, and some are cut (none without knobs)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    samplers = [Sampler(1.0, seed=r, **knobs) for r, knobs in enumerate(truncations)]
    steps = [s.next_step() for s in samplers]
    masked = sampling._truncate(samplers, steps, [s.params for s in samplers], logprobs)
    for r, knobs in enumerate(truncations):
        p = samplers[r].params
        reference = logprobs[r : r + 1]
        if p.top_p < 1.0:
            reference = apply_top_p(reference, p.top_p)
        if p.min_p > 0.0:
            reference = apply_min_p(reference, p.min_p)
        if p.xtc_probability > 0.0:
            reference = apply_xtc(reference, p.xtc_probability, p.xtc_threshold,
                                  list(p.xtc_special_tokens))
        if p.top_k > 0:
            reference = apply_top_k(reference, p.top_k)
        kept = np.isfinite(np.array(masked[r]))
        expected = np.isfinite(np.array(reference[0]))
        assert (kept == expected).all(), knobs
        assert 0 < kept.sum() < logits.shape[-1] or not knobs, knobs
    return masked


def test_truncations_keep_the_tokens_mlx_lms_sampler_chain_keeps():
    """Per row, in one batch: the tokens left by top-p, min-p, XTC (always applied here) and
    top-k are the ones mlx-lm's ``apply_*`` chain leaves."""
    logits = mx.random.normal((len(TRUNCATIONS), 200), key=mx.random.key(4)) * 3
    # Token 1 is one of row 7's likeliest: XTC would remove it but for its special id.
    logits[7, 1] = mx.max(logits[7]) + 0.5
    masked = assert_truncations_match_mlx_lm(TRUNCATIONS, logits)
    assert np.isfinite(np.array(masked[7]))[1]


def test_top_p_under_top_k_cuts_among_the_top_k_without_a_sort(monkeypatch):
    """Every top-p row also under top-k and no XTC: top-p's cut comes from the top-k
    candidates (no sort of the vocabulary), the same tokens as mlx-lm's chain, whether the cut
    falls among the k, below them, or after min-p's; rows beside them keep XTC."""
    monkeypatch.setattr(sampling, "_top_p", None)
    truncations = [
        dict(top_p=0.9, top_k=40), dict(top_p=0.3, top_k=7), dict(top_p=0.99, top_k=3),
        dict(top_p=0.95, min_p=0.02, top_k=30), dict(top_p=0.6, min_p=0.3, top_k=100),
        dict(top_k=5), dict(xtc_probability=1.0, xtc_threshold=0.05), dict(min_p=0.1), dict(),
    ]
    for seed in range(5):
        logits = mx.random.normal((len(truncations), 300), key=mx.random.key(seed)) * 2.5
        assert_truncations_match_mlx_lm(truncations, logits)


def reference_distribution(base, temperature, top_p=1.0, top_k=0, min_p=0.0):
    """float64: mlx-lm's truncations on the untempered probabilities, then the tempered
    softmax of what is left."""
    probs = np.exp(log_softmax64(base))
    kept = np.ones_like(probs, dtype=bool)
    order = np.argsort(-probs)
    kept[order[(np.cumsum(probs[order]) - probs[order]) >= top_p]] = False
    if min_p:
        kept &= probs >= min_p * probs.max()
    if top_k:
        kept &= probs >= np.sort(probs[kept])[::-1][top_k - 1]
    tempered = np.exp(log_softmax64(base / temperature))
    expected = np.where(kept, tempered, 0.0)
    return kept, expected / expected.sum()


@pytest.mark.parametrize(
    "knobs",
    [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.0, top_p=0.7),
     dict(temperature=0.5, top_p=0.8), dict(temperature=1.5, top_k=3),
     dict(temperature=2.0, min_p=0.2), dict(temperature=0.8, top_p=0.95, min_p=0.1, top_k=4)],
)
def test_samples_follow_the_truncated_tempered_softmax(knobs):
    """4,000 rows of one distribution, each its own seeded sampler: no truncated token is
    drawn and the counts match the float64 reference within 5 standard deviations."""
    rows = 4000
    base = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.0, 0.7])
    logits = mx.array(np.tile(base, (rows, 1)), dtype=mx.float32)
    samplers = [Sampler(seed=seed, **knobs) for seed in range(rows)]
    counts = np.bincount(np.array(sample_rows(samplers, logits).tokens), minlength=len(base))
    reference = {k: v for k, v in knobs.items() if k != "temperature"}
    kept, expected = reference_distribution(base, knobs["temperature"], **reference)
    assert counts[~kept].sum() == 0
    for token in np.flatnonzero(kept):
        sd = math.sqrt(rows * expected[token] * (1 - expected[token]))
        assert abs(counts[token] - rows * expected[token]) < 5 * sd + 1, token


def test_xtc_removes_the_likely_tokens_as_often_as_asked():
    """XTC with probability 0.5 over 4,000 seeded rows: about half of them never pick one of
    the tokens above the threshold but the least likely of those."""
    rows = 4000
    base = np.array([3.0, 2.8, 2.5, -1.0, -1.2, -2.0])
    logits = mx.array(np.tile(base, (rows, 1)), dtype=mx.float32)
    samplers = [Sampler(1.0, seed=s, xtc_probability=0.5, xtc_threshold=0.1) for s in range(rows)]
    counts = np.bincount(np.array(sample_rows(samplers, logits).tokens), minlength=len(base))
    probs = np.exp(log_softmax64(base))
    # Applied: token 2 and the unlikely ones; not applied: the plain softmax.
    applied = np.where(np.arange(6) >= 2, probs, 0.0) / probs[2:].sum()
    expected = 0.5 * applied + 0.5 * probs
    for token in range(6):
        sd = math.sqrt(rows * expected[token] * (1 - expected[token]))
        assert abs(counts[token] - rows * expected[token]) < 5 * sd + 1, token


def test_logprobs_report_the_processed_untruncated_distribution():
    """Chosen tokens' logprobs (sampled ones too, outside the top k) and the top k, best
    first, from the float64 log-softmax of the processed logits; rows asking fewer take the
    first entries, nothing is reported when no row asks."""
    logits, histories = penalized_batch(1000, seed=3)
    contexts = contexts_of(histories)
    asks = [None, 0, 1, 2, 5, None, 3]
    samplers = [Sampler(4.0, 1.0, seed=r, logprobs=k, top_k=50, **knobs)
                for r, (k, knobs) in enumerate(zip(asks, PROCESSOR_KNOBS))]
    sampled = sample_rows(samplers, logits, contexts)
    assert sampled.top_ids.shape == (7, 5) and sampled.top_ids.dtype == mx.int32
    assert sampled.logprobs.dtype == sampled.top_logprobs.dtype == mx.float32
    outside = 0
    for r, sampler in enumerate(samplers):
        expected = log_softmax64(mlx_lm_processed(sampler.params, logits[r : r + 1], histories[r]))[0]
        token = sampled.tokens[r].item()
        assert abs(sampled.logprobs[r].item() - expected[token]) < 1e-5
        outside += token not in sampled.top_ids[r].tolist()
        assert sampled.top_ids[r].tolist() == np.argsort(-expected)[:5].tolist()
        np.testing.assert_allclose(np.array(sampled.top_logprobs[r]), np.sort(expected)[::-1][:5],
                                   atol=1e-5)
    assert outside > 0
    only_zero = sample_rows([Sampler(logprobs=0), Sampler()], logits[:2])
    assert only_zero.logprobs.shape == (2,) and only_zero.top_ids is None
    assert only_zero.top_logprobs is None
    assert sample_rows([Sampler(), Sampler(1.0)], logits[:2]).logprobs is None


def test_prompt_logprobs_match_float64():
    logits = mx.random.normal((9, 500), key=mx.random.key(5)) * 3
    targets = mx.array([0, 7, 499, 3, 3, 250, 1, 2, 9], dtype=mx.int32)
    chosen, ids, values = prompt_logprobs(logits, targets, 4)
    expected = log_softmax64(logits)
    np.testing.assert_allclose(np.array(chosen), expected[np.arange(9), np.array(targets)], atol=1e-5)
    assert ids.tolist() == np.argsort(-expected, axis=-1)[:, :4].tolist()
    np.testing.assert_allclose(np.array(values), -np.sort(-expected, axis=-1)[:, :4], atol=1e-5)
    assert prompt_logprobs(logits, targets, 0)[1:] == (None, None)


def test_seeded_rows_with_every_knob_are_the_same_alone_or_in_any_batch():
    logits, histories = penalized_batch(1000, seed=6)
    contexts = contexts_of(histories)
    knobs = [dict(seed=11, top_k=5, xtc_probability=0.5, xtc_threshold=0.05),
             dict(seed=12, top_p=0.9, min_p=0.05), dict(),
             dict(seed=13, xtc_probability=1.0, xtc_threshold=0.01, xtc_special_tokens=(4,)),
             dict(top_k=3), dict(seed=14, min_p=0.2, logprobs=2), dict(seed=15)]
    knobs = [dict(temperature=0.0 if not k else 1.5, **k, **p)
             for k, p in zip(knobs, PROCESSOR_KNOBS)]
    seeded = [r for r, k in enumerate(knobs) if k.get("seed") is not None]
    together = [Sampler(**k) for k in knobs]
    alone = [Sampler(**k) for k in knobs]
    for step in range(6):
        batch = sample_rows(together, logits, contexts).tokens.tolist()
        single = [s(logits[r : r + 1], contexts[r : r + 1]).item() for r, s in enumerate(alone)]
        assert [batch[r] for r in seeded] == [single[r] for r in seeded], step
    order = [3, 0, 6, 5, 1, 2, 4]
    reordered = sample_rows([Sampler(**knobs[r]) for r in order], logits[mx.array(order)],
                            contexts[mx.array(order)]).tokens.tolist()
    again = sample_rows([Sampler(**k) for k in knobs], logits, contexts).tokens.tolist()
    assert all(reordered[i] == again[r] for i, r in enumerate(order) if r in seeded)


BAD_VALUES = [
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.1), ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan), ("presence_penalty", math.inf),
    ("frequency_penalty", math.nan), ("repetition_context_size", -1),
    ("presence_context_size", 1.0), ("frequency_context_size", -5),
    ("logit_bias", ((1, math.inf),)), ("logit_bias", ((-1, 1.0),)),
    ("logit_bias", ((1, 1.0), (1, 2.0))), ("logit_bias", ((1,),)), ("logit_bias", "1"),
    ("xtc_probability", 1.5), ("xtc_threshold", 0.6), ("xtc_threshold", -0.1),
    ("xtc_special_tokens", (3, -2)), ("xtc_special_tokens", 3),
    ("seed", -1), ("seed", 2**64), ("seed", 1.0), ("logprobs", -1), ("logprobs", 21),
    ("logprobs", 1.5),
]


@pytest.mark.parametrize("field, value", BAD_VALUES)
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_round_trip_as_json_and_know_their_context():
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
        repetition_context_size=64, presence_penalty=0.5, presence_context_size=8,
        frequency_penalty=-0.25, frequency_context_size=16, logit_bias={50256: -100.0, 3: 0.1},
        xtc_probability=0.3, xtc_threshold=0.2, xtc_special_tokens=[1, 2], seed=2**64 - 1,
        logprobs=20,
    )
    assert params.logit_bias == ((50256, -100.0), (3, 0.1))
    assert params.xtc_special_tokens == (1, 2)
    assert SamplingParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams.from_dict({"temprature": 1.0})
    assert params.context_size == 64
    assert SamplingParams().context_size == 0
    assert SamplingParams(repetition_penalty=1.0, repetition_context_size=99).context_size == 0
    assert SamplingParams(presence_penalty=1.0, presence_context_size=0).context_size == WHOLE_HISTORY
    assert SamplingParams(frequency_penalty=1.0, frequency_context_size=7).context_size == 7
    params.check_vocab(50257)
    with pytest.raises(ValueError, match="logit_bias"):
        params.check_vocab(50000)
    with pytest.raises(ValueError, match="xtc_special_tokens"):
        SamplingParams(xtc_special_tokens=(9,)).check_vocab(9)


def test_sampler_keeps_its_attributes_and_takes_params():
    params = SamplingParams(temperature=0.5, top_p=0.8, seed=9, top_k=4)
    sampler = Sampler.from_params(params, stream=2)
    assert (sampler.temperature, sampler.top_p, sampler.seed, sampler.stream) == (0.5, 0.8, 9, 2)
    assert sampler.params == params and not sampler.greedy
    assert Sampler(0.5, 0.8, 9, 2, top_k=4).params == params
    assert Sampler(logit_bias={2: 1.5}).params.logit_bias == ((2, 1.5),)
    logits = logits_of(1)
    twin = Sampler(0.5, 0.8, 9, 2, top_k=4)
    assert [sampler(logits).item() for _ in range(5)] == [twin(logits).item() for _ in range(5)]


def test_tokens_ruled_out_are_never_drawn_under_heavy_masking():
    """The inverse CDF over rows with almost all of the vocabulary at zero probability (-inf
    logits, among them the first and last tokens and runs between the live ones): 200 draws of
    each of 64 rows, seeded and not, only ever give live tokens, and each live token comes up."""
    vocab, rows = 4096, 64
    rng = np.random.default_rng(7)
    logits = np.full((rows, vocab), -np.inf, dtype=np.float32)
    live = [np.sort(rng.choice(np.arange(1, vocab - 1), 3, replace=False)) for _ in range(rows)]
    for r, tokens in enumerate(live):
        # One live token is far less likely than the others, but still possible.
        logits[r, tokens] = [0.0, 1.0, -3.0]
    logits = mx.array(logits)
    samplers = [Sampler(1.0, seed=r if r % 2 else None) for r in range(rows)]
    seen = [set() for _ in range(rows)]
    for _ in range(200):
        for r, token in enumerate(sample_rows(samplers, logits).tokens.tolist()):
            assert token in live[r], (r, token)
            seen[r].add(token)
    assert all(len(s) >= 2 for s in seen)
    assert sum(len(s) == 3 for s in seen) > rows // 2


def test_a_seeded_row_draws_the_same_alone_and_among_32_other_rows():
    """Row 0 keeps its seed and knobs; the 31 rows beside it change every step (other seeds,
    unseeded, greedy, other truncations), over a 32,000-token vocabulary."""
    vocab = 32000
    logits = mx.random.normal((32, vocab), key=mx.random.key(8)) * 3
    knobs = dict(temperature=0.9, seed=123, top_k=50, min_p=0.01)
    alone, together = Sampler(**knobs), Sampler(**knobs)
    rng = np.random.default_rng(9)
    others = [dict(), dict(temperature=1.0), dict(temperature=1.2, seed=5), dict(temperature=0.7, top_p=0.9),
              dict(temperature=1.0, seed=6, top_k=3), dict(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.01)]
    for step in range(8):
        beside = [Sampler(**others[i]) for i in rng.integers(0, len(others), 31)]
        batch = sample_rows([together] + beside, logits).tokens[0].item()
        assert batch == alone(logits[:1]).item(), step


def test_seeded_draws_are_counter_based_uniform_and_independent():
    """A seeded draw is a function of (seed, stream, step, slot): a sampler rebuilt from its
    params (a tensor-parallel follower's) draws the same numbers at any step. Over 2,000
    seeds, the draws lie on float32's 2^-24 grid in [0, 1), fill each tenth of it, and do not
    correlate across neighbouring seeds, streams of one seed, steps or slots."""
    sampler = Sampler(1.0, seed=7, stream=3)
    assert [sampler.next_step() for _ in range(3)] == [0, 1, 2]
    rebuilt = Sampler.from_params(sampler.params, stream=3)
    assert sampler.uniform(2, 1) == rebuilt.uniform(2, 1) != rebuilt.uniform(2, 0)
    assert Sampler(1.0).next_step() is None
    seeds = 2000
    draws = np.array([[[[Sampler(1.0, seed=seed, stream=stream).uniform(step, slot)
                         for slot in range(2)] for step in range(3)] for stream in range(2)]
                      for seed in range(seeds)])
    assert ((draws >= 0) & (draws < 1)).all() and (draws * 2**24 == np.floor(draws * 2**24)).all()
    counts = np.histogram(draws[:, 0, 0, 1], bins=10, range=(0, 1))[0]
    assert (np.abs(counts - seeds / 10) < 5 * math.sqrt(seeds * 0.09)).all()
    bound = 5 / math.sqrt(seeds)
    pairs = [(draws[:-1, 0, 0, 1], draws[1:, 0, 0, 1]), (draws[:, 0, 0, 1], draws[:, 1, 0, 1]),
             (draws[:, 0, 0, 1], draws[:, 0, 1, 1]), (draws[:, 0, 0, 0], draws[:, 0, 0, 1])]
    for a, b in pairs:
        assert abs(np.corrcoef(a, b)[0, 1]) < bound
