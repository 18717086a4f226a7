"""``BatchedDecoder``: continuous batched decoding of an unchanged mlx-lm model, the facade.

It maps its keywords onto the engine's configs (``config.py``), drives an ``EngineCore``
(``engine_core.py``: the ``Scheduler`` plans each step, the ``ModelRunner`` executes it on the
KV layouts) and keeps ``DecodeStats``: the work done and when each request's tokens came out.
``generate`` decodes a list of prompts to the end.

Dimension legend: B = requests in the step, V = vocabulary size.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from ..caches.paged_kv_cache import DEFAULT_POOL_LAYOUT, PagedKVCache
from ..tools.progress import ProgressBar
from .config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from .decode_stats import DecodeStats, RequestTiming
from .engine_core import EngineCore
from .grammar import GrammarCompiler, GrammarSpec
from .layouts.paged import PagedLayout
from .layouts.slot import SlotCache, SlotLayout
from .plan import StepResult
from .request import FinishReason
from .sampling import Sampler


class BatchedDecoder:
    """Batched decoding of an mlx-lm model (Llama, Qwen2, Qwen3, Mistral, Ministral 3, Gemma 2
    and 3, gpt-oss, DeepSeek-V2, MiniCPM3; DeepSeek-V3, Kimi K2 / K2.5 and GLM-4.7-Flash in
    latent space, ...), its code unchanged.

    Each step is one forward pass over the running requests' decode tokens and chunks of the
    prompts being fed, up to ``max_step_tokens``; a request's first token comes out of the step
    that feeds its prompt's last chunk; with a draft model a step is one speculative round.

    Args:
        model: an mlx-lm ``Model`` whose layers use ``KVCache`` (full attention) or
            ``RotatingKVCache`` (sliding window) and call mlx-lm's ``scaled_dot_product_attention``
            (attention sinks and any head dim are served; multi-head latent attention layers
            decode in latent space) or are Gemma 2's (soft caps).
        draft_model: an mlx-lm model with the same vocabulary, served the same way: decode
            speculatively, ``num_draft_tokens`` draft tokens per request and step.
        num_draft_tokens: k >= 1 (``SpeculativeConfig``).
        attention: ``"slot"`` (default: the op reads each layer's cache in place) or ``"seed"``
            (per-request caches, pad, concatenate, masked SDPA: the baseline,
            ``kv_layout="seed"`` of ``CacheConfig``).
        kv_step, kv_layout, block_size, pool_layout, prefix_sharing, max_kv_blocks,
        max_cached_blocks, kv_bits, kv_group_size: ``CacheConfig``'s (``kv_layout``
            ``"slot"`` or ``"paged"``).
        max_step_tokens, max_batch_size: ``SchedulerConfig``'s.
        grammar_compiler: compiles the grammars of constrained requests (``EngineCore``).

    Raises ``ValueError`` (``[BatchedDecoder] ...``) for a model or a combination it cannot
    serve, naming why.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        draft_model: Optional[nn.Module] = None,
        num_draft_tokens: int = 2,
        attention: str = "slot",
        kv_step: int = 256,
        kv_layout: str = "slot",
        block_size: int = 16,
        pool_layout: str = DEFAULT_POOL_LAYOUT,
        prefix_sharing: bool = True,
        max_kv_blocks: Optional[int] = None,
        max_cached_blocks: int = 256,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        max_step_tokens: int = 256,
        max_batch_size: Optional[int] = None,
        grammar_compiler: Optional[GrammarCompiler] = None,
    ):
        if attention not in ("slot", "seed"):
            raise ValueError(
                f"[BatchedDecoder] attention must be 'slot' or 'seed', got {attention!r}"
            )
        if kv_layout not in ("slot", "paged"):
            raise ValueError(
                f"[BatchedDecoder] kv_layout must be 'slot' or 'paged', got {kv_layout!r}"
            )
        if attention == "seed" and kv_layout == "paged":
            raise ValueError("[BatchedDecoder] kv_layout='paged' needs attention='slot'")
        config = EngineConfig(
            CacheConfig(
                kv_layout="seed" if attention == "seed" else kv_layout,
                kv_step=kv_step,
                block_size=block_size,
                pool_layout=pool_layout,
                prefix_sharing=prefix_sharing,
                max_kv_blocks=max_kv_blocks,
                max_cached_blocks=max_cached_blocks,
                kv_bits=kv_bits,
                kv_group_size=kv_group_size,
            ),
            SchedulerConfig(max_step_tokens=max_step_tokens, max_batch_size=max_batch_size),
            SpeculativeConfig(num_draft_tokens=num_draft_tokens),
            draft=draft_model is not None,
        )
        self.model = model
        self.draft_model = draft_model
        self.config = config
        self.core = EngineCore(model, config, draft_model, grammar_compiler=grammar_compiler)
        self.stats = DecodeStats()

    @property
    def num_active(self) -> int:
        """Requests holding a row: prefilling or decoding (B of the next step)."""
        return len(self.core.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests added but not yet holding a row (``max_batch_size`` or the block budget)."""
        return len(self.core.scheduler.waiting)

    @property
    def slot_caches(self) -> Optional[list[SlotCache]]:
        """The target's per-layer slot caches: ``SlotKVCache`` for full-attention layers,
        ``RingSlotKVCache`` for sliding-window ones (``QuantizedSlotKVCache`` for every layer
        with ``kv_bits``); ``None`` with another layout."""
        target = self.core.runner.target
        return target.caches if isinstance(target, SlotLayout) else None

    @property
    def draft_slot_caches(self) -> Optional[list[SlotCache]]:
        """The draft's per-layer slot caches (``None`` without a draft or on the seed path)."""
        draft = self.core.runner.draft
        return draft.caches if isinstance(draft, SlotLayout) else None

    @property
    def paged_cache(self) -> Optional[PagedKVCache]:
        """The target's ``PagedKVCache`` (``None`` with another layout)."""
        target = self.core.runner.target
        return target.cache if isinstance(target, PagedLayout) else None

    def check_request(self, prompt_len: int, max_tokens: int) -> None:
        """``ValueError`` unless a request of ``prompt_len`` prompt tokens and ``max_tokens``
        can be served: a prompt of at least one token, ``max_tokens >= 1``, and with a block
        budget (paged layout) no more blocks than it holds. Nothing is queued."""
        self.core.check_request(prompt_len, max_tokens)

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
        """Queue ``prompt`` (token ids, at least one) and return the request's id at once.

        The steps that follow feed its prompt in chunks beside the running requests' tokens;
        its first token comes out of the step that feeds its prompt's last chunk. A request
        ``max_batch_size`` or the block budget cannot hold yet waits until it fits.
        ``sampler``: how this request chooses its tokens (default: the sampler ``step`` gets).
        ``prompt_logprobs``: the steps report its prompt tokens' logprobs with the top k
        (``StepResult.prompt_logprobs``); ``max_tokens`` 0 then asks for nothing else.
        ``grammar``/``grammar_after``: its output must match it (``EngineCore.add_request``;
        needs ``grammar_compiler``).
        ``ValueError`` as ``check_request`` says, before anything is queued.
        """
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
        """As ``add_request``, one choice per sampler (their ids, in order): the prompt is fed
        once and its keys/values shared by every choice (``EngineCore.add_choices``)."""
        arrived = time.perf_counter()
        uids = self.core.add_choices(
            prompt, max_tokens, samplers, stop_tokens=stop_tokens,
            prompt_logprobs=prompt_logprobs, grammar=grammar, grammar_after=grammar_after,
        )
        for uid in uids:
            self.stats.requests[uid] = RequestTiming(arrived)
        self._count_blocks()
        return uids

    def add_prefilled_request(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        keys_values: Sequence[tuple[mx.array, mx.array]],
        *,
        draft_keys_values: Optional[Sequence[tuple[mx.array, mx.array]]] = None,
        stop_tokens: Iterable[int] = (),
    ) -> int:
        """As ``add_request``, with the keys/values of all but the prompt's last token given:
        per layer ``[1, H_kv, len(prompt) - 1, D]`` (RoPE applied, unquantized), the draft
        model's in ``draft_keys_values``. The next step feeds the last token alone. Slot
        layout only (a cache saved earlier, or a benchmark's seeded contexts)."""
        arrived = time.perf_counter()
        uid = self.core.add_prefilled_request(
            prompt, max_tokens, keys_values, draft_keys_values, stop_tokens=stop_tokens
        )
        self.stats.requests[uid] = RequestTiming(arrived)
        return uid

    def step(self, sampler: Optional[Sampler] = None) -> StepResult:
        """One step for every active request, greedy unless ``sampler`` (or a request's own)
        says otherwise: one token each, or with a draft model one speculative round (1 to
        k + 1 tokens each)."""
        start = time.perf_counter()
        plan = self.core.schedule()
        if plan is None:
            raise ValueError("[BatchedDecoder] step() needs at least one active request")
        result = self.core.run(plan, sampler)
        self._count(result, start, time.perf_counter(), plan.fed_prompts)
        return result

    def _count(self, result: StepResult, start: float, end: float, fed_prompts: bool) -> None:
        """The stats of one step that ran from ``start`` to ``end``."""
        stats = self.stats
        stats.prompt_tokens += result.prompt_tokens
        stats.prefix_hit_tokens += result.prefix_hit_tokens
        stats.draft_tokens += result.draft_tokens
        stats.accepted_tokens += result.accepted_tokens
        for uid, tokens in result.tokens.items():
            stats.requests[uid].emitted(len(tokens), end)
        for uid in result.finished:
            timing = stats.requests[uid]
            timing.finished = end
            timing.prefix_hit_tokens = result.cached_tokens[uid]
        stats.steps += 1
        generated = sum(len(t) for t in result.tokens.values())
        stats.generated_tokens += generated
        if fed_prompts:
            stats.prefill_seconds += end - start
        else:
            stats.decode_seconds += end - start
            stats.decode_steps += 1
            stats.decode_step_tokens += generated
        self._count_blocks()

    def _count_blocks(self) -> None:
        cache = self.paged_cache
        if cache is not None:
            self.stats.blocks_in_use = cache.blocks_in_use

    def cancel(self, uid: int) -> bool:
        """Drop request ``uid``, queued or running: its slot (or its blocks) is free at once and
        it emits nothing more. Returns ``False`` when no such request is queued or running
        (never added, finished or cancelled already)."""
        request = self.core.finish(uid, FinishReason.CANCELLED)
        if request is None:
            return False
        timing = self.stats.requests[uid]
        timing.finished = time.perf_counter()
        timing.cancelled = True
        timing.prefix_hit_tokens = request.prefix_hit_tokens
        self._count_blocks()
        return True

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Union[int, Sequence[int]] = 128,
        *,
        max_batch_size: Optional[int] = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stop_tokens: Iterable[int] = (),
        progress: bool = False,
    ) -> list[list[int]]:
        """Decode every prompt; returns each request's generated token ids, in prompt order.

        At most ``max_batch_size`` requests decode at once (the decoder's by default); the
        others wait in order and join as soon as one leaves. Greedy by default;
        ``temperature``/``top_p`` sample, each request from its own stream of ``seed``. Stop
        tokens end a request and are not included in its tokens. ``progress`` draws a bar on
        stderr.
        """
        if self.core.has_requests:
            raise ValueError("[BatchedDecoder] generate() needs an idle decoder")
        budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        if len(budgets) != len(prompts):
            raise ValueError("[BatchedDecoder] need one max_tokens per prompt")
        # Checked as the scheduler's own limit is.
        SchedulerConfig(max_batch_size=max_batch_size)
        default = Sampler(temperature, top_p)
        stop_tokens = tuple(stop_tokens)
        results: list[list[int]] = [[] for _ in prompts]
        index_of: dict[int, int] = {}
        bar = ProgressBar(sum(budgets), "tokens") if progress else None
        with self.core.scheduler.limited(max_batch_size):
            for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
                if budget > 0:
                    own = None if seed is None else Sampler(temperature, top_p, seed, stream=i)
                    uid = self.add_request(prompt, budget, stop_tokens=stop_tokens, sampler=own)
                    index_of[uid] = i
            while self.core.has_requests:
                result = self.step(default)
                for uid, tokens in result.tokens.items():
                    results[index_of[uid]] += tokens
                if bar is not None:
                    # A request that stops early gives back the rest of its budget.
                    stopped = sum(
                        budgets[index_of[u]] - len(results[index_of[u]]) for u in result.finished
                    )
                    bar.update(sum(len(t) for t in result.tokens.values()) + stopped)
        if bar is not None:
            bar.close()
        return results
