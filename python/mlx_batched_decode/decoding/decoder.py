"""``BatchedDecoder``: continuous batched decoding of an unchanged mlx-lm model.

Each request is prefilled on its own (all but its last prompt token), then joins the running
batch; every decode step runs the model once over all active requests with one
``BatchedDecodeContext`` shared by all layers. With a draft model a step is one speculative round
(``speculative.py``): the draft proposes ``num_draft_tokens`` tokens per request and the target
verifies them all in one forward pass, so a request gains 1 to ``num_draft_tokens + 1`` tokens per
step. A request leaves when it reaches its ``max_tokens`` or samples a stop token; the last row's
request then moves into the freed row (slot), so the active requests always fill rows ``0..B-1``
and the next request reuses the free one. With ``kv_layout="paged"`` the keys/values live in the
blocks of a ``PagedKVCache`` instead (``paged_served_model.py``): nothing moves when a request
leaves, requests whose prompts start alike share the cached blocks of that prefix, and a request
the block budget cannot hold yet waits until others leave. ``cancel`` drops a queued or running
request at once; ``stats.requests`` times each request's tokens (``RequestTiming``).

Dimension legend: B = requests in the step, V = vocabulary size.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from ..caches.paged_kv_cache import DEFAULT_POOL_LAYOUT, POOL_LAYOUTS, PagedKVCache
from ..caches.quantized_kv_cache import check_quantization
from ..tools.progress import ProgressBar
from .decode_stats import DecodeStats, RequestTiming
from .paged_served_model import PagedServedModel
from .sampling import Sampler
from .served_model import ServedModel, SlotCache
from .speculative import speculative_round


class StepResult(NamedTuple):
    """What one decode step produced: ``tokens[uid]``, the tokens each request emitted in order
    (one per step without a draft model, up to ``num_draft_tokens + 1`` with one; requests that
    emitted nothing are absent, and a stop token is never emitted), and the ids of the requests
    that finished in this step."""

    tokens: dict[int, list[int]]
    finished: list[int]


@dataclass
class _Request:
    uid: int
    max_tokens: int
    stop_tokens: frozenset[int]
    seq_len: int
    next_token: int
    tokens: list[int] = field(default_factory=list)


class BatchedDecoder:
    """Batched decoding of an mlx-lm model (Llama, Qwen2, Qwen3, Mistral, Ministral 3, Gemma 3,
    gpt-oss, ...), its code unchanged.

    Args:
        model: an mlx-lm ``Model`` whose layers use ``KVCache`` (full attention) or
            ``RotatingKVCache`` (sliding window) and call mlx-lm's ``scaled_dot_product_attention``
            (attention sinks and any head dim are served).
        draft_model: an mlx-lm model with the same vocabulary, served the same way: decode
            speculatively, ``num_draft_tokens`` draft tokens per request and step.
        num_draft_tokens: k >= 1, draft tokens per request per step (with ``draft_model``).
        attention: ``"slot"`` (default: ``SlotKVCache`` + ``batched_decode_attention``, zero
            copy; a sliding-window layer keeps only its last ``window + k`` positions per
            request in a ``RingSlotKVCache``, k = ``num_draft_tokens`` with a draft model, else
            0) or ``"seed"`` (per-request ``ContiguousKVCache``, pad, concatenate, masked SDPA).
        kv_step: the caches grow in chunks of this many positions.
        prefill_step_size: prompt tokens per prefill forward pass.
        kv_layout: ``"slot"`` (default: one cache row per request) or ``"paged"``
            (``PagedKVCache`` block pools + ``paged_decode_attention``; with ``attention="slot"``
            and no draft model).
        block_size: positions per block (paged layout).
        pool_layout: how the paged layout stores its pools: ``"token-major"`` (default) or
            ``"head-major"`` (see ``PagedKVCache``; the two measured alike).
        prefix_sharing: share the cached blocks of equal prompt prefixes (paged layout; models
            with full-attention layers only).
        max_kv_blocks: the block budget (paged layout, ``None``: unbounded). A request is
            admitted when blocks for its whole length (prompt + ``max_tokens``) can be reserved;
            until then it waits, and it never waits once decoding.
        max_cached_blocks: the most prompt blocks no request holds that are kept for later
            requests (paged layout with prefix sharing), least recently used out first.
        kv_bits: 8 or 4 to keep keys and values quantized (``QuantizedSlotKVCache`` +
            ``quantized_batched_decode_attention``), as mlx-lm's ``generate_step(kv_bits=...,
            kv_group_size=..., quantized_kv_start=0)`` does, the draft model's too; ``None``
            (default) keeps them in the model's dtype. Needs ``attention="slot"`` and
            ``kv_layout="slot"``.
        kv_group_size: elements per quantization group (32, 64 or 128; it must divide the head
            dims), with ``kv_bits``.

    Raises ``ValueError`` (``[BatchedDecoder] ...``) for a model it cannot serve, naming why.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        draft_model: Optional[nn.Module] = None,
        num_draft_tokens: int = 2,
        attention: str = "slot",
        kv_step: int = 256,
        prefill_step_size: int = 2048,
        kv_layout: str = "slot",
        block_size: int = 16,
        pool_layout: str = DEFAULT_POOL_LAYOUT,
        prefix_sharing: bool = True,
        max_kv_blocks: Optional[int] = None,
        max_cached_blocks: int = 256,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
    ):
        if kv_layout not in ("slot", "paged"):
            raise ValueError(
                f"[BatchedDecoder] kv_layout must be 'slot' or 'paged', got {kv_layout!r}"
            )
        if kv_layout == "paged":
            if attention != "slot":
                raise ValueError(
                    f"[BatchedDecoder] kv_layout='paged' needs attention='slot', got {attention!r}"
                )
            if draft_model is not None:
                raise ValueError(
                    "[BatchedDecoder] kv_layout='paged' does not decode speculatively: "
                    "pass no draft_model"
                )
            if block_size < 1:
                raise ValueError(f"[BatchedDecoder] block_size must be >= 1, got {block_size}")
            if pool_layout not in POOL_LAYOUTS:
                raise ValueError(
                    f"[BatchedDecoder] pool_layout must be one of {POOL_LAYOUTS}, "
                    f"got {pool_layout!r}"
                )
            if max_kv_blocks is not None and max_kv_blocks < 1:
                raise ValueError(
                    f"[BatchedDecoder] max_kv_blocks must be >= 1 or None, got {max_kv_blocks}"
                )
            if max_cached_blocks < 0:
                raise ValueError(
                    f"[BatchedDecoder] max_cached_blocks must be >= 0, got {max_cached_blocks}"
                )
        if attention not in ("slot", "seed"):
            raise ValueError(
                f"[BatchedDecoder] attention must be 'slot' or 'seed', got {attention!r}"
            )
        if kv_bits is not None:
            check_quantization("BatchedDecoder", kv_bits, kv_group_size)
            if kv_layout != "slot":
                raise ValueError(
                    "[BatchedDecoder] kv_bits needs kv_layout='slot': paged pools are not quantized"
                )
            if attention != "slot":
                raise ValueError(
                    "[BatchedDecoder] kv_bits needs attention='slot': the seed path keeps "
                    "unquantized per-request caches"
                )
        if num_draft_tokens < 1:
            raise ValueError(
                f"[BatchedDecoder] num_draft_tokens must be >= 1, got {num_draft_tokens}"
            )
        self.model = model
        self.draft_model = draft_model
        self.num_draft_tokens = num_draft_tokens
        self.attention_path = attention
        self.kv_step = kv_step
        self.prefill_step_size = prefill_step_size
        self.kv_layout = kv_layout
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self._paged: Optional[PagedServedModel] = None
        if kv_layout == "paged":
            self._paged = PagedServedModel(
                model,
                block_size=block_size,
                pool_layout=pool_layout,
                prefix_sharing=prefix_sharing,
                max_blocks=max_kv_blocks,
                max_cached_blocks=max_cached_blocks,
                prefill_step_size=prefill_step_size,
            )
        # Rings of windowed layers keep room for the positions a speculative round may roll back.
        lookahead = 0 if draft_model is None else num_draft_tokens
        self._target = (
            self._paged
            if self._paged is not None
            else ServedModel(
                model, attention, kv_step, prefill_step_size, kv_bits, kv_group_size, lookahead
            )
        )
        self._draft: Optional[ServedModel] = None
        if draft_model is not None:
            self._draft = ServedModel(
                draft_model,
                attention,
                kv_step,
                prefill_step_size,
                kv_bits,
                kv_group_size,
                lookahead,
            )
            target_vocab, draft_vocab = self._target.vocab_size(), self._draft.vocab_size()
            if target_vocab != draft_vocab:
                raise ValueError(
                    f"[BatchedDecoder] the draft model's vocabulary ({draft_vocab} tokens) differs "
                    f"from the target's ({target_vocab})"
                )
        self._active: list[_Request] = []
        # Paged layout: added requests the block budget cannot hold yet, in arrival order.
        self._waiting: deque[tuple[_Request, list[int]]] = deque()
        self._next_uid = 0
        self.stats = DecodeStats()

    @property
    def num_active(self) -> int:
        """Requests currently decoding (B of the next step)."""
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        """Requests added but not yet decoding: the block budget cannot hold them yet."""
        return len(self._waiting)

    @property
    def slot_caches(self) -> Optional[list[SlotCache]]:
        """The target's per-layer slot caches on the zero-copy path: ``SlotKVCache`` for
        full-attention layers, ``RingSlotKVCache`` for sliding-window ones (``QuantizedSlotKVCache``
        for every layer with ``kv_bits``; ``None`` on the seed path and with the paged layout)."""
        return None if self._paged is not None else self._target.slot_caches

    @property
    def paged_cache(self) -> Optional[PagedKVCache]:
        """The target's ``PagedKVCache`` (``None`` with the slot layout)."""
        return None if self._paged is None else self._paged.cache

    @property
    def draft_slot_caches(self) -> Optional[list[SlotCache]]:
        """The draft's per-layer slot caches (``None`` on the seed path or without a draft)."""
        return None if self._draft is None else self._draft.slot_caches

    def _models(self) -> list[ServedModel]:
        return [self._target] if self._draft is None else [self._target, self._draft]

    def add_request(
        self, prompt: Sequence[int], max_tokens: int, *, stop_tokens: Iterable[int] = ()
    ) -> int:
        """Prefill ``prompt`` (token ids, at least one), add it to the running batch, return its id.

        The request's first token comes out of the next ``step``; with the paged layout, a
        request the block budget cannot hold yet waits, and its first token comes out of the
        first ``step`` after it fits.
        """
        if len(prompt) == 0:
            raise ValueError("[BatchedDecoder] a prompt needs at least one token")
        if max_tokens < 1:
            raise ValueError(f"[BatchedDecoder] max_tokens must be >= 1, got {max_tokens}")
        prompt = [int(t) for t in prompt]
        arrived = time.perf_counter()
        request = _Request(
            uid=self._next_uid,
            max_tokens=max_tokens,
            stop_tokens=frozenset(int(t) for t in stop_tokens),
            seq_len=len(prompt) - 1,
            next_token=prompt[-1],
        )
        self._next_uid += 1
        if self._paged is not None:
            cache = self._paged.cache
            needed = cache.blocks_for(len(prompt) - 1 + max_tokens)
            budget = cache.allocator.max_blocks
            if budget is not None and needed > budget:
                raise ValueError(
                    f"[BatchedDecoder] a request of {len(prompt)} prompt tokens and max_tokens="
                    f"{max_tokens} needs {needed} blocks, more than max_kv_blocks={budget}"
                )
            self.stats.requests[request.uid] = RequestTiming(arrived)
            self._waiting.append((request, prompt[:-1]))
            self._admit_waiting()
            return request.uid
        self.stats.requests[request.uid] = RequestTiming(arrived)
        start = time.perf_counter()
        for served in self._models():
            served.admit(len(self._active), prompt[:-1])
        self._active.append(request)
        self.stats.prompt_tokens += len(prompt) - 1
        self.stats.prefill_seconds += time.perf_counter() - start
        return request.uid

    def _admit_waiting(self) -> None:
        """Paged layout: prefill waiting requests, first come first, while the budget holds them."""
        while self._waiting:
            request, prefilled = self._waiting[0]
            start = time.perf_counter()
            total_len = request.seq_len + request.max_tokens
            hit = self._paged.admit(request.uid, prefilled, total_len)
            if hit is None:
                return
            self._waiting.popleft()
            self._active.append(request)
            self.stats.prompt_tokens += len(prefilled)
            self.stats.prefix_hit_tokens += hit
            self.stats.blocks_in_use = self._paged.cache.blocks_in_use
            self.stats.prefill_seconds += time.perf_counter() - start

    def step(self, sampler: Optional[Sampler] = None) -> StepResult:
        """One decode step for every active request, greedy unless ``sampler`` says otherwise:
        one token each, or with a draft model one speculative round (1 to k + 1 tokens each)."""
        if self._waiting:
            self._admit_waiting()
        if not self._active:
            raise ValueError("[BatchedDecoder] step() needs at least one active request")
        sampler = sampler or Sampler()
        start = time.perf_counter()
        seq_lens = [r.seq_len for r in self._active]
        next_tokens = [r.next_token for r in self._active]
        if self._draft is None:
            inputs = mx.array(next_tokens, dtype=mx.int32)[:, None]
            sampled = sampler(self._target.forward(inputs, seq_lens)[:, -1, :])
            mx.eval(sampled)
            proposals = [[token] for token in sampled.tolist()]
        else:
            spec = speculative_round(
                self._target, self._draft, next_tokens, seq_lens, self.num_draft_tokens, sampler
            )
            proposals = spec.tokens
            self.stats.draft_tokens += spec.drafted
            self.stats.accepted_tokens += spec.accepted
        emitted: dict[int, list[int]] = {}
        finished_rows = []
        for row, (request, tokens) in enumerate(zip(self._active, proposals)):
            # Every proposed token's keys/values but the last are now in both caches.
            request.seq_len += len(tokens)
            request.next_token = tokens[-1]
            out, done = [], False
            for token in tokens:
                if token in request.stop_tokens:
                    done = True
                    break
                out.append(token)
                if len(request.tokens) + len(out) >= request.max_tokens:
                    done = True
                    break
            request.tokens += out
            if out:
                emitted[request.uid] = out
            if done:
                finished_rows.append(row)
        finished = [self._active[row].uid for row in finished_rows]
        for row in reversed(finished_rows):
            self._remove(row)
        if self._paged is not None:
            self.stats.blocks_in_use = self._paged.cache.blocks_in_use
        end = time.perf_counter()
        for uid, tokens in emitted.items():
            self.stats.requests[uid].emitted(len(tokens), end)
        for uid in finished:
            self.stats.requests[uid].finished = end
        self.stats.steps += 1
        self.stats.generated_tokens += sum(len(t) for t in emitted.values())
        self.stats.decode_seconds += end - start
        return StepResult(emitted, finished)

    def cancel(self, uid: int) -> bool:
        """Drop request ``uid``, queued or running: its slot (or its blocks) is free at once and
        it emits nothing more. Returns ``False`` when no such request is queued or running
        (never added, finished or cancelled already)."""
        timing = self.stats.requests.get(uid)
        if timing is None or timing.finished is not None:
            return False
        row = next((i for i, r in enumerate(self._active) if r.uid == uid), None)
        if row is not None:
            self._remove(row)
        else:
            # Queued for the block budget: it holds nothing yet.
            self._waiting = deque(w for w in self._waiting if w[0].uid != uid)
        if self._paged is not None:
            self.stats.blocks_in_use = self._paged.cache.blocks_in_use
        timing.finished = time.perf_counter()
        timing.cancelled = True
        return True

    def _remove(self, row: int) -> None:
        last = len(self._active) - 1
        if self._paged is not None:
            self._paged.release(row, last)
        else:
            for served in self._models():
                served.release(row, last, self._active[last].seq_len)
        self._active[row] = self._active[last]
        self._active.pop()

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

        At most ``max_batch_size`` requests decode at once (all by default); a waiting request
        joins as soon as one leaves. Greedy by default; ``temperature``/``top_p``/``seed`` sample.
        Stop tokens end a request and are not included in its tokens. ``progress`` draws a bar on
        stderr.
        """
        if self._active or self._waiting:
            raise ValueError("[BatchedDecoder] generate() needs an idle decoder")
        budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        if len(budgets) != len(prompts):
            raise ValueError("[BatchedDecoder] need one max_tokens per prompt")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"[BatchedDecoder] max_batch_size must be >= 1, got {max_batch_size}")
        sampler = Sampler(temperature, top_p, seed)
        stop_tokens = tuple(stop_tokens)
        results: list[list[int]] = [[] for _ in prompts]
        waiting = deque(i for i, budget in enumerate(budgets) if budget > 0)
        index_of: dict[int, int] = {}
        bar = ProgressBar(sum(budgets), "tokens") if progress else None
        while waiting or self._active or self._waiting:
            while waiting and (
                max_batch_size is None or len(self._active) + len(self._waiting) < max_batch_size
            ):
                i = waiting.popleft()
                index_of[self.add_request(prompts[i], budgets[i], stop_tokens=stop_tokens)] = i
            result = self.step(sampler)
            for uid, tokens in result.tokens.items():
                results[index_of[uid]] += tokens
            if bar is not None:
                # A request that stops early gives back the rest of its budget.
                stopped = sum(
                    budgets[index_of[uid]] - len(results[index_of[uid]]) for uid in result.finished
                )
                bar.update(sum(len(t) for t in result.tokens.values()) + stopped)
        if bar is not None:
            bar.close()
        return results
