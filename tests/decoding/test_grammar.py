"""Grammar-constrained decoding (structured output) on a random-weight model with a byte-level
tokenizer (any text reachable, a padded vocabulary): at temperature 1 every constrained answer
matches its grammar (JSON schema, any JSON object, regex, choice), plain requests beside
constrained ones sample exactly as alone, drafts change nothing, every choice of an n-choice
request matches on its own, ``grammar_after`` leaves the thinking section free, a grammar that
does not compile is refused before anything is queued, and without the masks the answers stop
matching (the check has teeth).
"""

import json
import re

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("llguidance")

import mlx_lm.utils  # noqa: E402

from mlx_batched_decode.decoding import runner as runner_module  # noqa: E402
from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.decoding.grammar import GrammarCompiler, GrammarSpec  # noqa: E402
from mlx_batched_decode.decoding.request import FinishReason  # noqa: E402
from mlx_batched_decode.decoding.sampling import Sampler  # noqa: E402
from mlx_batched_decode.tools.model_folder import (  # noqa: E402
    BYTE_EOS_ID,
    BYTE_THINK_END_ID,
    BYTE_VOCAB,
    save_byte_model_folder,
)
from tests.support.mlx_lm_models import SMALL_LLAMA  # noqa: E402

# Ten padding ids past the tokenizer's: never allowed under a grammar.
VOCAB = BYTE_VOCAB + 10
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "b": {"type": "boolean"},
        "c": {"enum": ["x", "y"]},
        "d": {"type": "string", "maxLength": 8},
    },
    "required": ["a", "b", "c", "d"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}( [a-z]{2,6}){0,3}\."
CHOICES = ["yes", "no", "maybe"]
SPECS = {
    "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "json_object": GrammarSpec("json_object"),
    "regex": GrammarSpec("regex", REGEX),
    "choice": GrammarSpec("choice", json.dumps(CHOICES)),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_byte_model_folder(dict(SMALL_LLAMA, vocab_size=VOCAB), tmp_path_factory.mktemp("m"), seed=1)
    model, tokenizer = mlx_lm.utils.load(str(path))
    draft, _ = mlx_lm.utils.load(
        str(save_byte_model_folder(dict(SMALL_LLAMA, vocab_size=VOCAB), tmp_path_factory.mktemp("d"), seed=2))
    )
    return model, draft, tokenizer, GrammarCompiler(tokenizer, VOCAB)


def decoder(served, **options):
    model, draft, _, compiler = served
    drafts = options.pop("drafts", None)
    if drafts:
        # "self": the target drafts for itself, unconstrained (the grammar rejects some).
        options["draft_model"] = model if drafts == "self" else draft
    return BatchedDecoder(model, kv_step=16, grammar_compiler=compiler, **options)


def drain(dec):
    """Steps until every request ended: each uid's tokens, logprobs and finish reason."""
    tokens, logprobs, reasons = {}, {}, {}
    while dec.core.has_requests:
        result = dec.step()
        for uid, new in result.tokens.items():
            tokens.setdefault(uid, []).extend(new)
        for uid, entries in result.logprobs.items():
            logprobs.setdefault(uid, []).extend(entries)
        reasons.update(result.reasons)
    return tokens, logprobs, reasons


def prompt(tokenizer, text="hi"):
    return tokenizer.encode(f"<|user|> {text} <|assistant|>")


def valid(kind, text):
    """Whether ``text`` is a complete answer of grammar ``kind`` (the schema checked by hand)."""
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if kind == "json_object":
        return isinstance(value, dict)
    return (
        isinstance(value, dict) and set(value) == set(SCHEMA["properties"])
        and type(value["a"]) is int and type(value["b"]) is bool and value["c"] in ("x", "y")
        and isinstance(value["d"], str) and len(value["d"]) <= 8
    )


def answers(served, kind, seeds=range(24), max_tokens=200, **options):
    """``len(seeds)`` requests of grammar ``kind`` in one batch at temperature 1: each one's
    (text, tokens, finish reason)."""
    tokenizer = served[2]
    dec = decoder(served, **options)
    uids = [
        dec.add_request(prompt(tokenizer), max_tokens, stop_tokens=[BYTE_EOS_ID],
                        sampler=Sampler(1.0, seed=s), grammar=SPECS[kind])
        for s in seeds
    ]
    tokens, _, reasons = drain(dec)
    return [(tokenizer.decode(tokens.get(u, [])), tokens.get(u, []), reasons[u]) for u in uids]


def prefix_accepted(served, kind, tokens):
    """Whether a fresh matcher of ``kind`` accepts every token (an answer cut by max_tokens)."""
    matcher = served[3].matcher(SPECS[kind])
    return matcher.validate_tokens(tokens) == len(tokens)


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_constrained_answer_matches(served, kind):
    results = answers(served, kind)
    stopped = [(text, tokens) for text, tokens, reason in results if reason == FinishReason.STOP]
    # Any JSON object may nest and run on past max_tokens; the bounded grammars never do.
    assert len(stopped) >= (12 if kind == "json_object" else 24)
    for text, tokens in stopped:
        assert valid(kind, text), text
        assert max(tokens) < BYTE_VOCAB
    for text, tokens, reason in results:
        assert reason in (FinishReason.STOP, FinishReason.LENGTH)
        if reason == FinishReason.LENGTH:
            assert prefix_accepted(served, kind, tokens)
    # Random answers, not one answer 24 times.
    assert len({text for text, _ in stopped}) > (2 if kind == "choice" else 8)


def test_without_the_masks_answers_stop_matching(served, monkeypatch):
    plain = runner_module.sample_rows
    monkeypatch.setattr(
        runner_module, "sample_rows", lambda s, logits, contexts=None, masks=None: plain(s, logits, contexts)
    )
    results = answers(served, "regex", seeds=range(8))
    assert not all(valid("regex", text) for text, _, _ in results)
    # The matchers saw tokens their grammar forbids.
    assert FinishReason.ERROR in {reason for _, _, reason in results}


def test_a_completed_grammar_ends_the_request_without_a_stop_token(served):
    tokenizer = served[2]
    dec = decoder(served)
    uids = [dec.add_request(prompt(tokenizer), 50, sampler=Sampler(1.0, seed=s),
                            grammar=SPECS["choice"]) for s in range(6)]
    tokens, _, reasons = drain(dec)
    for uid in uids:
        assert reasons[uid] == FinishReason.STOP
        assert tokenizer.decode(tokens[uid]) in CHOICES


def plain_requests(tokenizer):
    return [(prompt(tokenizer, f"q{i}"), Sampler(1.0, seed=100 + i) if i % 2 else None)
            for i in range(6)]


@pytest.mark.parametrize("layout", [{}, dict(kv_layout="paged", block_size=8)])
def test_plain_requests_beside_constrained_ones_sample_as_alone(served, layout):
    tokenizer = served[2]
    alone = decoder(served, **layout)
    for p, sampler in plain_requests(tokenizer):
        alone.add_request(p, 24, sampler=sampler)
    expected = drain(alone)[0]
    mixed = decoder(served, **layout)
    plain, constrained = [], []
    for i, (p, sampler) in enumerate(plain_requests(tokenizer)):
        plain.append(mixed.add_request(p, 24, sampler=sampler))
        kind = list(SPECS)[i % len(SPECS)]
        constrained.append((kind, mixed.add_request(
            prompt(tokenizer), 60, stop_tokens=[BYTE_EOS_ID], sampler=Sampler(1.0, seed=i),
            grammar=SPECS[kind])))
    tokens, _, reasons = drain(mixed)
    assert [tokens[u] for u in plain] == [expected[u] for u in sorted(expected)]
    for kind, uid in constrained:
        if reasons[uid] == FinishReason.STOP:
            assert valid(kind, tokenizer.decode(tokens[uid]))


@pytest.mark.parametrize("kind", ["json_schema", "regex"])
def test_drafts_with_grammars_equal_no_drafts(served, kind):
    """Greedy: the same tokens with a draft model as without, whether it is another random
    model or the target itself (drafting unconstrained: the grammar rejects some of its
    tokens, accepts others). Seeded sampling verifies k + 1 rows per round, each drawing its
    step of the stream, so its tokens differ with drafts (grammar or not): there every answer
    matches."""
    def run(temperature, **options):
        tokenizer = served[2]
        dec = decoder(served, **options)
        uids = [dec.add_request(prompt(tokenizer, f"q{s}"), 80, stop_tokens=[BYTE_EOS_ID],
                                sampler=Sampler(temperature, seed=s), grammar=SPECS[kind])
                for s in range(6)]
        # A plain neighbour too.
        uids.append(dec.add_request(prompt(tokenizer), 20, sampler=Sampler(temperature, seed=9)))
        tokens, _, reasons = drain(dec)
        return [(tokens.get(u), reasons[u]) for u in uids], dec

    expected, _ = run(0.0)
    drafted, _ = run(0.0, drafts=True, num_draft_tokens=3)
    assert drafted == expected
    drafted, dec = run(0.0, drafts="self", num_draft_tokens=3)
    assert drafted == expected
    assert 0 < dec.stats.accepted_tokens < dec.stats.draft_tokens
    sampled, _ = run(1.0, drafts=True, num_draft_tokens=3)
    for tokens, reason in sampled[:-1]:
        if reason == FinishReason.STOP:
            assert valid(kind, served[2].decode(tokens))
        else:
            assert reason == FinishReason.LENGTH and prefix_accepted(served, kind, tokens)


def test_every_choice_matches_on_its_own_with_logprobs(served):
    tokenizer = served[2]
    samplers = [Sampler(1.0, seed=3, stream=j, logprobs=3) for j in range(4)]
    dec = decoder(served)
    uids = dec.add_choices(prompt(tokenizer), 120, samplers, stop_tokens=[BYTE_EOS_ID],
                           grammar=SPECS["regex"])
    tokens, logprobs, reasons = drain(dec)
    for uid, sampler in zip(uids, samplers):
        assert reasons[uid] == FinishReason.STOP
        assert valid("regex", tokenizer.decode(tokens[uid]))
        # The same sampler alone gives the same answer.
        alone = decoder(served)
        own = alone.add_request(prompt(tokenizer), 120, stop_tokens=[BYTE_EOS_ID],
                                sampler=Sampler(1.0, seed=3, stream=sampler.stream, logprobs=3),
                                grammar=SPECS["regex"])
        assert drain(alone)[0][own] == tokens[uid]
        # Logprobs of the constrained distribution: the first token is a lowercase letter,
        # and so are the top 3.
        first = logprobs[uid][0]
        assert all(ord("a") <= t <= ord("z") for t, _ in first.top)
        assert first.logprob > -float("inf")


def test_grammar_after_leaves_the_thinking_section_free(served):
    tokenizer = served[2]
    dec = decoder(served)
    # A bias makes the section's end likely; past it the grammar forbids it anyway.
    uids = [dec.add_request(prompt(tokenizer), 120, stop_tokens=[BYTE_EOS_ID],
                            sampler=Sampler(1.0, seed=s, logit_bias={BYTE_THINK_END_ID: 3.0}),
                            grammar=SPECS["regex"], grammar_after=BYTE_THINK_END_ID)
            for s in range(12)]
    tokens, _, reasons = drain(dec)
    free = 0
    for uid in uids:
        out = tokens[uid]
        if BYTE_THINK_END_ID not in out:
            continue
        cut = out.index(BYTE_THINK_END_ID)
        thinking, answer = out[:cut], out[cut + 1:]
        free += any(not (ord("a") <= t <= ord("z") or t in b" .") for t in thinking)
        if reasons[uid] == FinishReason.STOP:
            assert valid("regex", tokenizer.decode(answer))
    assert free > 0
    assert sum(BYTE_THINK_END_ID in tokens[u] for u in uids) >= 6


def test_a_grammar_that_does_not_compile_is_refused_before_queueing(served):
    model, _, tokenizer, _ = served
    dec = decoder(served)
    for spec in [GrammarSpec("regex", "a("), GrammarSpec("json_schema", "{"),
                 GrammarSpec("json_schema", '{"type": "nope"}'), GrammarSpec("lark", "start: x"),
                 GrammarSpec("choice", "[1,")]:
        with pytest.raises(ValueError, match="invalid"):
            dec.add_choices(prompt(tokenizer), 10, [None, None], grammar=spec)
    with pytest.raises(ValueError, match="grammar"):
        dec.add_request(prompt(tokenizer), 10, grammar_after=BYTE_THINK_END_ID)
    with pytest.raises(ValueError, match="grammar_after"):
        dec.add_request(prompt(tokenizer), 10, grammar=SPECS["regex"], grammar_after=VOCAB)
    with pytest.raises(ValueError, match="no grammar compiler"):
        BatchedDecoder(model, kv_step=16).add_request(prompt(tokenizer), 10, grammar=SPECS["regex"])
    with pytest.raises(ValueError, match="kind"):
        GrammarSpec("xml", "")
    assert not dec.core.has_requests


@pytest.mark.parametrize("vocab, extra_words", [(272, 0), (300, -2), (1000, 1)])
def test_masks_forbid_exactly_the_cleared_bits(vocab, extra_words):
    """``sample_rows``' mask step: -inf where a row's bit is clear (and past the bitmask's
    words), the logits themselves elsewhere, other rows untouched; any rows, in runs or not."""
    import mlx.core as mx
    import numpy as np

    from mlx_batched_decode.decoding.sampling import _constrain

    rng = np.random.default_rng(vocab)
    width, count = (vocab + 31) // 32 + extra_words, 9
    logits = rng.standard_normal((count, vocab)).astype(np.float32)
    for rows in [None, [0], [1, 2, 3, 7], [8], [2, 4, 5]]:
        picked = list(range(count)) if rows is None else rows
        bitmask = rng.integers(-(2**31), 2**31 - 1, (len(picked), width)).astype(np.int32)
        got = np.array(_constrain(mx.array(logits), rows, mx.array(bitmask)))
        columns = np.arange(min(vocab, 32 * width))
        expected = np.full((len(picked), vocab), -np.inf, dtype=np.float32)
        allowed = (bitmask[:, columns >> 5] >> (columns & 31)) & 1 == 1
        expected[:, columns] = np.where(allowed, logits[picked][:, columns], -np.inf)
        reference = logits.copy()
        reference[picked] = expected
        assert np.array_equal(got, reference)
