"""``EngineCore``: one model's scheduler, runner and KV layouts, stepped together.

The interface a server (or ``BatchedDecoder``) drives from the engine's thread: ``add_request``
(or ``add_choices``: n choices of one prompt, fed once) and ``finish``, then ``schedule`` and
``run`` for each step (the plan in between goes to
tensor-parallel followers, which execute the same plans on their own runner). Each
``StepResult`` says what every request emitted, which finished and why, and the counts a
server reports; nothing else of the engine needs to be read.

Dimension legend: V = vocabulary size.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from .config import EngineConfig
from .grammar import GrammarCompiler, GrammarSpec
from .layouts import make_layout
from .mlx_lm_caches import layer_windows
from .plan import Snapshot, StepPlan, StepResult
from .request import FinishReason, Request
from .runner import ModelRunner
from .sampling import Sampler
from .scheduler import Scheduler


class EngineCore:
    """Serves ``model`` (and speculatively ``draft_model``) as ``config`` says.

    ``grammar_compiler``: what constrained requests (``grammar=``) compile with, built for
    the model's tokenizer (every tensor-parallel rank needs one: followers make the same
    matchers); without one a request with a grammar is refused.

    Raises ``ValueError`` (``[BatchedDecoder] ...``) for a model it cannot serve, naming why,
    or a draft model of another vocabulary.
    """

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig,
        draft_model: Optional[nn.Module] = None,
        *,
        grammar_compiler: Optional[GrammarCompiler] = None,
    ):
        self.config = config
        self.grammar_compiler = grammar_compiler
        cache, scheduler = config.cache, config.scheduler
        k = config.speculative.num_draft_tokens if draft_model is not None else 0
        # A request's chunk: at most max_step_tokens, and where rings keep windowed layers
        # (the unquantized slot layout) at most the smallest window: a ring holds the window
        # behind its first row.
        rings = cache.kv_layout == "slot" and cache.kv_bits is None
        windows = [w for w in layer_windows(model) if w is not None and rings]
        chunk_limit = min([scheduler.max_step_tokens, *windows])
        # Rings make room for the positions a speculative round may roll back, or a chunk.
        lookahead = max(chunk_limit - 1, k)
        target = make_layout(model, cache, lookahead)
        draft = None
        if draft_model is not None:
            draft = make_layout(draft_model, cache, lookahead)
            target_vocab, draft_vocab = target.vocab_size(), draft.vocab_size()
            if target_vocab != draft_vocab:
                raise ValueError(
                    f"[BatchedDecoder] the draft model's vocabulary ({draft_vocab} tokens) differs "
                    f"from the target's ({target_vocab})"
                )
        self.runner = ModelRunner(target, draft, grammar_compiler)
        self.scheduler = Scheduler(scheduler, target, k, chunk_limit)
        self._next_uid = 0
        self._vocab_size: Optional[int] = None

    @property
    def vocab_size(self) -> int:
        """V, the logits one token gets (measured once)."""
        if self._vocab_size is None:
            self._vocab_size = self.runner.target.vocab_size()
        return self._vocab_size

    def check_request(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """``ValueError`` unless such a request of ``n`` choices can be served
        (``Scheduler.check``); reads only the configuration, so any thread may call it."""
        self.scheduler.check(prompt_len, max_tokens, n)

    def _request(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        stop_tokens: Iterable[int],
        sampler: Optional[Sampler],
    ) -> Request:
        if sampler is not None:
            sampler.params.check_vocab(self.vocab_size)
        request = Request(
            self._next_uid,
            [int(t) for t in prompt],
            max_tokens,
            frozenset(int(t) for t in stop_tokens),
            sampler,
        )
        self._next_uid += 1
        return request

    def add_request(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        stop_tokens: Iterable[int] = (),
        sampler: Optional[Sampler] = None,
        prompt_logprobs: Optional[int] = None,
        grammar: Optional[GrammarSpec] = None,
        grammar_after: Optional[int] = None,
    ) -> int:
        """Queue ``prompt`` (token ids) and return its request id; the next steps admit it when
        there is room and feed its prompt in chunks. ``stop_tokens`` end it (the tokenizer's
        end-of-sequence ids, say), ``sampler`` chooses its tokens (``None``: the step's);
        ``max_tokens`` 0 ends it once its prompt is fed. ``prompt_logprobs``: report its prompt
        tokens' logprobs with the top k (``StepResult.prompt_logprobs``).

        ``grammar``: its output must match it (structured output): each step samples only the
        tokens its grammar allows (end-of-sequence tokens exactly where the text so far
        satisfies it), and it ends with ``FinishReason.STOP`` when it samples a stop token or
        its grammar admits nothing more. ``grammar_after``: a token id (a thinking section's
        end) whose first generated occurrence starts the constraint; it and the tokens before
        it are free. ``ValueError`` before anything is queued when the engine has no
        ``grammar_compiler`` or the grammar does not compile (llguidance's message)."""
        return self.add_choices(
            prompt, max_tokens, [sampler], stop_tokens=stop_tokens,
            prompt_logprobs=prompt_logprobs, grammar=grammar, grammar_after=grammar_after,
        )[0]

    def add_choices(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        samplers: Sequence[Optional[Sampler]],
        *,
        stop_tokens: Iterable[int] = (),
        prompt_logprobs: Optional[int] = None,
        grammar: Optional[GrammarSpec] = None,
        grammar_after: Optional[int] = None,
    ) -> list[int]:
        """As ``add_request``, for one choice per sampler: the ids, in order. The prompt is fed
        once, by the first choice (which reports its ``prompt_logprobs``); the others start
        from its keys/values, each sampling its first token from its prompt's last logits.
        Each choice matches ``grammar`` on its own (a matcher of its own)."""
        if not samplers:
            raise ValueError("[BatchedDecoder] add_choices needs at least one sampler")
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= 20:
            raise ValueError(
                f"[BatchedDecoder] prompt_logprobs must be in [0, 20], got {prompt_logprobs}"
            )
        self.check_request(len(prompt), max_tokens, len(samplers))
        self._check_grammar(grammar, grammar_after)
        stop_tokens = list(stop_tokens)
        choices = [self._request(prompt, max_tokens, stop_tokens, s) for s in samplers]
        first = choices[0]
        first.prompt_logprobs, first.forks = prompt_logprobs, choices[1:]
        first.grammar, first.grammar_after = grammar, grammar_after
        self.scheduler.add(first)
        return [c.uid for c in choices]

    def _check_grammar(self, grammar: Optional[GrammarSpec], after: Optional[int]) -> None:
        """``ValueError`` unless ``grammar`` (and ``after``) can constrain a request here."""
        if grammar is None:
            if after is not None:
                raise ValueError("[BatchedDecoder] grammar_after needs a grammar")
            return
        if self.grammar_compiler is None:
            raise ValueError("[BatchedDecoder] this engine has no grammar compiler: no grammar")
        if after is not None and not 0 <= after < self.vocab_size:
            raise ValueError(
                f"[BatchedDecoder] grammar_after must be a token id in [0, {self.vocab_size}), "
                f"got {after}"
            )
        try:
            self.grammar_compiler.check(grammar)
        except ValueError as error:
            raise ValueError(f"[BatchedDecoder] {error}") from None

    def add_prefilled_request(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        keys_values: Sequence[tuple[mx.array, mx.array]],
        draft_keys_values: Optional[Sequence[tuple[mx.array, mx.array]]] = None,
        *,
        stop_tokens: Iterable[int] = (),
    ) -> int:
        """As ``add_request``, running at once with the keys/values of all but the prompt's
        last token stored (``BatchedDecoder.add_prefilled_request``); ``ValueError`` before
        anything is stored for keys/values of other lengths, draft keys/values given or missing
        against the draft model, or the paged layout."""
        if self.config.cache.kv_layout == "paged":
            raise ValueError("[BatchedDecoder] add_prefilled_request needs kv_layout='slot'")
        if (draft_keys_values is None) != (self.runner.draft is None):
            raise ValueError(
                "[BatchedDecoder] pass draft_keys_values exactly when decoding with a draft model"
            )
        lengths = {kv[0].shape[2] for kv in [*keys_values, *(draft_keys_values or ())]}
        if len(prompt) == 0 or lengths != {len(prompt) - 1}:
            raise ValueError(
                f"[BatchedDecoder] the keys/values must hold the {len(prompt) - 1} positions "
                f"before the prompt's last token, got {sorted(lengths)}"
            )
        self.check_request(len(prompt), max_tokens)
        request = self._request(prompt, max_tokens, stop_tokens, None)
        request.num_cached = len(request.prompt) - 1
        self.scheduler.add_running(request)
        loads = [keys_values, draft_keys_values] if request.num_cached else [None, None]
        # Its row changes applied at once, in order (the copy's time stays out of the next
        # step's): an engine with tensor-parallel followers does not load requests this way.
        self.runner.apply(self.scheduler.take_row_changes(), {request.uid: loads})
        return request.uid

    def finish(self, uid: int, reason: FinishReason = FinishReason.CANCELLED) -> Optional[Request]:
        """End request ``uid`` now (``Scheduler.finish``): the request, or ``None``."""
        self.runner.forget([uid])
        return self.scheduler.finish(uid, reason)

    def schedule(self) -> Optional[StepPlan]:
        """The next step's plan (``None``: no request to run)."""
        return self.scheduler.schedule()

    def run(self, plan: StepPlan, sampler: Optional[Sampler] = None) -> StepResult:
        """Execute ``plan`` and apply what it produced; ``sampler`` for requests without one."""
        output = self.runner.execute(plan, sampler)
        result = self.scheduler.update(plan, output)
        self.runner.forget(result.finished)
        return result

    @property
    def has_requests(self) -> bool:
        return self.scheduler.num_requests > 0

    def snapshot(self) -> Snapshot:
        return self.scheduler.snapshot()
