"""The batched sampler: every row in one pass with its own knobs, a seeded request's tokens from
its own random stream (the same alone or in any batch), temperature sampling that follows the
softmax, and requests with other knobs side by side in one decoder step."""

import math

import mlx.core as mx
import numpy as np
import pytest

import mlx_batched_decode.decoding.sampling as sampling
from mlx_batched_decode.decoding.sampling import Sampler, sample_rows

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
        batch = sample_rows(together, logits).tolist()
        single = [s(logits[r : r + 1]).item() for r, s in enumerate(alone)]
        assert batch == single, step
    # Another order of the same requests: the same tokens, row by row.
    reordered = [Sampler(*k) for k in knobs[::-1]]
    again = [Sampler(*k) for k in knobs]
    assert sample_rows(reordered, logits[::-1]).tolist()[::-1] == sample_rows(again, logits).tolist()


def test_one_batched_pass_for_many_seeded_requests(monkeypatch):
    calls = []
    real = sampling._sample

    def counting(samplers, logits):
        calls.append(len(samplers))
        return real(samplers, logits)

    monkeypatch.setattr(sampling, "_sample", counting)
    samplers = [Sampler(1.0, 0.95, seed) for seed in range(32)]
    sample_rows(samplers, logits_of(32))
    assert calls == [32]


def test_greedy_rows_and_a_tiny_top_p_take_the_argmax():
    logits = logits_of(4, seed=3)
    argmax = mx.argmax(logits, axis=-1).tolist()
    samplers = [Sampler(), Sampler(5.0, 1e-6, 1), Sampler(), Sampler(5.0, 1e-6)]
    assert sample_rows(samplers, logits).tolist() == argmax


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
    counts = np.bincount(np.array(sample_rows(samplers, logits)), minlength=len(base))
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
