"""Batched speculative decoding: greedy tokens identical to decoding without a draft, whatever the
draft proposes; one target pass of L = k + 1 rows per step; sampling keeps the target's
distribution."""

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from mlx.utils import tree_map  # noqa: E402

import mlx_batched_decode  # noqa: E402
from mlx_batched_decode.decoding.runner import ModelRunner  # noqa: E402
from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.decoding.mlx_lm_caches import layer_windows  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import VOCAB, random_prompts  # noqa: E402
from tests.decoding.test_decoder_windows import FAMILIES, build  # noqa: E402

PROMPT_LENS = [1, 9, 60, 16, 17, 33, 2]
MAX_TOKENS = [24, 24, 24, 5, 24, 1, 12]


def perturbed(model, family, scale, seed=5):
    """The model with every weight moved by ``scale`` times its mean size in random directions:
    a draft that agrees with it on some tokens and not on others."""
    draft = random_model(FAMILIES[family], seed=seed)
    mx.random.seed(seed)
    draft.update(
        tree_map(
            lambda p: p + scale * mx.abs(p).mean() * mx.random.normal(p.shape), model.parameters()
        )
    )
    mx.eval(draft.parameters())
    return draft


@pytest.fixture(scope="module")
def targets():
    return {family: build(family) for family in ("gpt_oss", "llama")}


@pytest.fixture(scope="module")
def drafts(targets):
    return {
        family: {
            "self": target,
            "unrelated": random_model(FAMILIES[family], seed=2),
            "perturbed": perturbed(target, family, 0.15),
        }
        for family, target in targets.items()
    }


@pytest.fixture(scope="module")
def plain(targets):
    """Greedy tokens without a draft (themselves equal to mlx-lm's, test_decoder_windows.py)."""
    return {
        family: BatchedDecoder(target, kv_step=16).generate(
            random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3
        )
        for family, target in targets.items()
    }


@pytest.mark.parametrize("num_draft_tokens", [1, 3])
@pytest.mark.parametrize("draft", ["self", "unrelated", "perturbed"])
@pytest.mark.parametrize("family", ["gpt_oss", "llama"])
def test_greedy_equals_decoding_without_draft(
    targets, drafts, plain, family, draft, num_draft_tokens, monkeypatch
):
    accepted_per_round = []
    real_execute = ModelRunner.execute

    def recording_execute(runner, plan, *args):
        output = real_execute(runner, plan, *args)
        # The running requests' rows: a prompt's first token is no draft round.
        accepted_per_round.append(
            [len(t) - 1 for t, n in zip(output.tokens, plan.next_tokens) if n is not None]
        )
        return output

    monkeypatch.setattr(ModelRunner, "execute", recording_execute)
    decoder = BatchedDecoder(
        targets[family],
        draft_model=drafts[family][draft],
        num_draft_tokens=num_draft_tokens,
        kv_step=16,
    )
    out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3)
    assert out == plain[family]
    assert decoder.num_active == 0
    stats = decoder.stats
    accepted = [a for round_ in accepted_per_round for a in round_]
    accepted_per_round = [r for r in accepted_per_round if r]
    assert stats.steps >= len(accepted_per_round)
    assert stats.draft_tokens == num_draft_tokens * len(accepted)
    assert stats.accepted_tokens == sum(accepted)
    assert stats.generated_tokens == sum(len(t) for t in out)
    if draft == "self":
        assert stats.acceptance_rate == 1.0
    elif draft == "unrelated":
        assert stats.acceptance_rate < 0.1
    else:
        # Mixed: within one round, some requests accept drafts and others reject them.
        assert any(min(r) == 0 and max(r) > 0 for r in accepted_per_round)
        assert 0.05 < stats.acceptance_rate < 0.95


def test_seed_path_and_stop_tokens(targets, drafts, plain):
    expected = plain["llama"]
    stop = next(t for ref in expected for t in ref if ref.index(t) >= 3)
    truncated = [ref[: ref.index(stop)] if stop in ref else ref for ref in expected]
    for path in ("slot", "seed"):
        decoder = BatchedDecoder(
            targets["llama"],
            draft_model=drafts["llama"]["perturbed"],
            num_draft_tokens=3,
            attention=path,
            kv_step=16,
        )
        out = decoder.generate(
            random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3, stop_tokens=[stop]
        )
        assert out == truncated


def test_one_target_pass_per_step_with_k_plus_1_rows(targets, drafts, monkeypatch):
    k, target, draft = 3, targets["gpt_oss"], drafts["gpt_oss"]["unrelated"]
    calls = []
    real_op = mlx_batched_decode.batched_decode_attention

    def spy(queries, keys, values, lens, **kwargs):
        calls.append((queries.shape, lens, kwargs.get("query_starts"), kwargs.get("ring_offset")))
        return real_op(queries, keys, values, lens, **kwargs)

    decoder = BatchedDecoder(target, draft_model=draft, num_draft_tokens=k)
    seq_lens = []
    # Prompts within one chunk (at most the window, 16): one step takes them all.
    for prompt in random_prompts([15, 3, 12]):
        decoder.add_request(prompt, 10)
        seq_lens.append(len(prompt))
    decoder.step()  # the prompts, in the draft's first pass and the target's
    monkeypatch.setattr(mlx_batched_decode, "batched_decode_attention", spy)
    decoder.step()
    layers = len(target.layers)
    # The draft: k + 1 single-token passes over both layers; then the target: one call per
    # layer with L = k + 1 (decode tokens alone: the plain layout, no query_starts).
    assert [c[0][2] for c in calls] == [1] * ((k + 1) * len(draft.layers)) + [k + 1] * layers
    assert all(c[2] is None for c in calls)
    window_ring = max(decoder.core.scheduler.chunk_limit - 1, k)
    for (shape, lens, _, ring_offset), window in zip(calls[-layers:], layer_windows(target)):
        ends = [n + k + 1 for n in seq_lens]
        assert shape[0] == 3
        if window is None:
            assert lens.tolist() == ends and ring_offset is None
        else:
            # The sliding layer's ring: the last positions, via its offset.
            ring = window + window_ring
            assert lens.tolist() == [min(e, ring) for e in ends]
            assert ring_offset.tolist() == [max(e - ring, 0) for e in ends]


def test_round_copies_no_cache_buffer(targets, drafts):
    decoder = BatchedDecoder(
        targets["llama"], draft_model=drafts["llama"]["perturbed"], num_draft_tokens=3, kv_step=4096
    )
    for prompt in random_prompts([40, 3, 25]):
        decoder.add_request(prompt, 100)
    decoder.step()
    # The full-attention layer's buffer; the sliding layer keeps a ring of 16 + 3 positions.
    buffer_bytes = max(c.keys.nbytes for c in decoder.slot_caches)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    decoder.step()
    assert mx.get_peak_memory() - base < buffer_bytes / 8


def test_draft_must_share_the_vocabulary(targets):
    other = random_model(dict(FAMILIES["llama"], vocab_size=VOCAB + 1))
    with pytest.raises(ValueError, match=r"^\[BatchedDecoder\] the draft model's vocabulary"):
        BatchedDecoder(targets["llama"], draft_model=other)
    with pytest.raises(ValueError, match=r"^\[BatchedDecoder\] num_draft_tokens"):
        BatchedDecoder(targets["llama"], draft_model=targets["llama"], num_draft_tokens=0)


def test_sampling_keeps_the_target_distribution():
    """Temperature 1 over a vocabulary of 8: the 2nd and 3rd tokens of 1200 samples follow the
    target's exact marginals, with a draft whose own distribution is far from the target's."""
    config = dict(FAMILIES["llama"], vocab_size=8, layer_types=None, sliding_window=None)
    target = random_model(config, seed=3)
    draft = random_model(config, seed=4)
    # A nearly deterministic draft: emitting its tokens unverified would be plain to see.
    draft.lm_head.weight = 20 * draft.lm_head.weight
    prompt = [1, 5, 2]

    def probs(sequences):
        logits = target(mx.array(sequences))[:, -1, :]
        return np.array(mx.softmax(logits, axis=-1))

    first = probs([prompt])[0]
    second = probs([prompt + [a] for a in range(8)])
    third = probs([prompt + [a, b] for a in range(8) for b in range(8)]).reshape(8, 8, 8)
    exact = [first @ second, np.einsum("a,ab,abc->c", first, second, third)]

    # Sampling noise alone gives a total variation distance of about 0.03 at this count.
    samples = 1200
    for draft_model in (None, draft):
        decoder = BatchedDecoder(target, draft_model=draft_model, num_draft_tokens=2)
        out = np.array(decoder.generate([prompt] * samples, 3, temperature=1.0, seed=11))
        for position, marginal in zip((1, 2), exact):
            seen = np.bincount(out[:, position], minlength=8) / samples
            assert 0.5 * np.abs(seen - marginal).sum() < 0.07, (draft_model is None, position)
    draft_first = mx.softmax(draft(mx.array([prompt]))[0, -1]).tolist()
    assert max(draft_first) > 0.8 and 0.5 * np.abs(np.array(draft_first) - first).sum() > 0.3
