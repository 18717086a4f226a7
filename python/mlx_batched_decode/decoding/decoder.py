"""``BatchedDecoder``: continuous batched decoding of an unchanged mlx-lm model.

A request joins the batch when it is added; every step runs the model once over the running
requests' decode tokens and chunks of the prompts being fed, first come first served, up to
``max_step_tokens`` tokens (decode tokens always run), with one ``PackedDecodeContext`` shared
by all layers (``_packed_step``); a request's first token comes out of the step that feeds its
prompt's last chunk. With a draft model a step is one speculative round (``speculative.py``):
the draft proposes ``num_draft_tokens`` tokens per running request and the target verifies them
all in one forward pass, so a request gains 1 to ``num_draft_tokens + 1`` tokens per step. Every
attention path and cache layout runs these steps, the seed path (the pad-and-concatenate
baseline) too. A request leaves when it reaches its ``max_tokens`` or samples a stop token; the
last row's request then moves into the freed row (slot), so the active requests always fill rows
``0..B-1`` and the next request reuses the free one. With ``kv_layout="paged"`` the keys/values
live in the blocks of a ``PagedKVCache`` instead (``paged_served_model.py``): nothing moves when
a request leaves, requests whose prompts start alike share the cached blocks of that prefix, and
a request the block budget cannot hold yet waits until others leave. ``cancel`` drops a queued,
prefilling or running request at once; ``stats.requests`` times each request's tokens
(``RequestTiming``).

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
from ..caches.prefix_hashes import block_hashes
from .paged_served_model import PagedServedModel
from .mlx_lm_caches import layer_windows
from .sampling import Sampler
from .served_model import ServedModel, SlotCache
from .speculative import PackedRound, packed_round


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
    # The whole prompt, fed in chunks; seq_len counts its tokens cached so far.
    prompt: list[int] = field(default_factory=list)
    # Paged layout with prefix sharing: the names of its prompt's full blocks, once computed.
    block_names: Optional[list[int]] = None
    # Its own way of choosing tokens (None: the step's).
    sampler: Optional[Sampler] = None

    @property
    def prefilling(self) -> bool:
        return self.seq_len < len(self.prompt)


class BatchedDecoder:
    """Batched decoding of an mlx-lm model (Llama, Qwen2, Qwen3, Mistral, Ministral 3, Gemma 2
    and 3, gpt-oss, DeepSeek-V2, MiniCPM3; DeepSeek-V3, Kimi K2 / K2.5 and GLM-4.7-Flash in
    latent space, ...), its code unchanged.

    Args:
        model: an mlx-lm ``Model`` whose layers use ``KVCache`` (full attention) or
            ``RotatingKVCache`` (sliding window) and call mlx-lm's ``scaled_dot_product_attention``
            (attention sinks and any head dim are served; multi-head latent attention layers
            decode in latent space, ``latent_attention``) or are Gemma 2's (soft caps).
        draft_model: an mlx-lm model with the same vocabulary, served the same way: decode
            speculatively, ``num_draft_tokens`` draft tokens per request and step.
        num_draft_tokens: k >= 1, draft tokens per request per step (with ``draft_model``).
        attention: ``"slot"`` (default: ``SlotKVCache`` + ``batched_decode_attention``, zero
            copy; a sliding-window layer keeps only its last ``window + max(c - 1, k)`` positions
            per request in a ``RingSlotKVCache``, c the longest prompt chunk a step feeds it,
            k = ``num_draft_tokens`` with a draft model, else 0) or ``"seed"`` (per-request
            ``ContiguousKVCache``, pad, concatenate, masked SDPA: the baseline).
        kv_step: the caches grow in chunks of this many positions.
        kv_layout: ``"slot"`` (default: one cache row per request) or ``"paged"``
            (``PagedKVCache`` block pools + ``paged_decode_attention``; with ``attention="slot"``
            and no draft model).
        block_size: positions per block (paged layout).
        pool_layout: how the paged layout stores its pools: ``"token-major"`` (default) or
            ``"head-major"`` (see ``PagedKVCache``; the two measured alike).
        prefix_sharing: share the cached blocks of equal prompt prefixes (paged layout).
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
            dims of keys and values, for MLA the latent's and the latent + rope rows'), with
            ``kv_bits``.
        max_step_tokens: the tokens of a step (>= 1): every running request's decode tokens
            (they always run, past it too), then chunks of the prompts being fed, first come
            first served; where rings keep windowed layers, a request's chunk is at most the
            smallest window.

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
        kv_layout: str = "slot",
        block_size: int = 16,
        pool_layout: str = DEFAULT_POOL_LAYOUT,
        prefix_sharing: bool = True,
        max_kv_blocks: Optional[int] = None,
        max_cached_blocks: int = 256,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        max_step_tokens: int = 256,
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
            )
        if max_step_tokens < 1:
            raise ValueError(
                f"[BatchedDecoder] max_step_tokens must be >= 1, got {max_step_tokens}"
            )
        self.max_step_tokens = max_step_tokens
        # A request's chunk: at most max_step_tokens, and with rings (windowed layers of the
        # zero-copy slot layout) at most the smallest window: a ring holds the window behind its
        # first row.
        rings = attention == "slot" and kv_layout == "slot" and kv_bits is None
        windows = [w for w in layer_windows(model) if w is not None and rings]
        self._chunk_limit = min([max_step_tokens, *windows])
        # Rings of windowed layers keep room for the positions a speculative round may roll
        # back, or for a chunk: R = window + chunk - 1 (at most 2 x window - 1).
        lookahead = max(self._chunk_limit - 1, 0 if draft_model is None else num_draft_tokens)
        self._target = (
            self._paged
            if self._paged is not None
            else ServedModel(model, attention, kv_step, kv_bits, kv_group_size, lookahead)
        )
        self._draft: Optional[ServedModel] = None
        if draft_model is not None:
            self._draft = ServedModel(
                draft_model, attention, kv_step, kv_bits, kv_group_size, lookahead
            )
            target_vocab, draft_vocab = self._target.vocab_size(), self._draft.vocab_size()
            if target_vocab != draft_vocab:
                raise ValueError(
                    f"[BatchedDecoder] the draft model's vocabulary ({draft_vocab} tokens) differs "
                    f"from the target's ({target_vocab})"
                )
        self._active: list[_Request] = []
        # Paged layout: added requests the block budget cannot hold yet, in arrival order.
        self._waiting: deque[_Request] = deque()
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
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        stop_tokens: Iterable[int] = (),
        sampler: Optional[Sampler] = None,
    ) -> int:
        """Queue ``prompt`` (token ids, at least one) and return the request's id at once.

        The steps that follow feed its prompt in chunks beside the running requests' tokens;
        its first token comes out of the step that feeds its prompt's last chunk. With the
        paged layout, a request the block budget cannot hold yet waits until it fits.
        ``sampler``: how this request chooses its tokens (default: the sampler ``step`` gets).
        ``ValueError`` as ``check_request`` says, before anything is queued.
        """
        self.check_request(len(prompt), max_tokens)
        prompt = [int(t) for t in prompt]
        request = self._new_request(prompt, max_tokens, stop_tokens)
        request.prompt, request.seq_len, request.sampler = prompt, 0, sampler
        if self._paged is None:
            for served in self._models():
                served.load(len(self._active), None)
            self._active.append(request)
        else:
            self._waiting.append(request)
            self._admit_waiting()
        return request.uid

    def check_request(self, prompt_len: int, max_tokens: int) -> None:
        """``ValueError`` unless a request of ``prompt_len`` prompt tokens and ``max_tokens``
        can be served: a prompt of at least one token, ``max_tokens >= 1``, and with a block
        budget (paged layout) no more blocks than it holds. Nothing is queued."""
        if prompt_len < 1:
            raise ValueError("[BatchedDecoder] a prompt needs at least one token")
        if max_tokens < 1:
            raise ValueError(f"[BatchedDecoder] max_tokens must be >= 1, got {max_tokens}")
        if self._paged is not None:
            cache = self._paged.cache
            needed = cache.blocks_for(prompt_len - 1 + max_tokens)
            budget = cache.allocator.max_blocks
            if budget is not None and needed > budget:
                raise ValueError(
                    f"[BatchedDecoder] a request of {prompt_len} prompt tokens and max_tokens="
                    f"{max_tokens} needs {needed} blocks, more than max_kv_blocks={budget}"
                )

    def _new_request(
        self, prompt: list[int], max_tokens: int, stop_tokens: Iterable[int]
    ) -> _Request:
        """A new request's state and timing."""
        request = _Request(
            uid=self._next_uid,
            max_tokens=max_tokens,
            stop_tokens=frozenset(int(t) for t in stop_tokens),
            seq_len=len(prompt) - 1,
            next_token=prompt[-1],
        )
        self._next_uid += 1
        self.stats.requests[request.uid] = RequestTiming(time.perf_counter())
        return request

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
        if self._paged is not None:
            raise ValueError("[BatchedDecoder] add_prefilled_request needs kv_layout='slot'")
        if (draft_keys_values is None) != (self._draft is None):
            raise ValueError(
                "[BatchedDecoder] pass draft_keys_values exactly when decoding with a draft model"
            )
        lengths = {kv[0].shape[2] for kv in [*keys_values, *(draft_keys_values or ())]}
        if len(prompt) == 0 or lengths != {len(prompt) - 1}:
            raise ValueError(
                f"[BatchedDecoder] the keys/values must hold the {len(prompt) - 1} positions "
                f"before the prompt's last token, got {sorted(lengths)}"
            )
        if max_tokens < 1:
            raise ValueError(f"[BatchedDecoder] max_tokens must be >= 1, got {max_tokens}")
        prompt = [int(t) for t in prompt]
        request = self._new_request(prompt, max_tokens, stop_tokens)
        for served, layers_kv in zip(self._models(), (keys_values, draft_keys_values)):
            served.load(len(self._active), layers_kv if len(prompt) > 1 else None)
        # The last prompt token is the one left to feed.
        request.prompt = prompt
        self._active.append(request)
        return request.uid

    def _admit_waiting(self) -> None:
        """Paged layout: give waiting requests rows, first come first, while the block budget
        holds them; a request starts past the cached blocks its prompt begins with."""
        while self._waiting:
            request = self._waiting[0]
            if self._awaits_shared_blocks(request):
                return
            # Every position but the last generated token's is written.
            total_len = len(request.prompt) - 1 + request.max_tokens
            hit = self._paged.admit(request.uid, request.prompt[:-1], total_len)
            if hit is None:
                return
            self._waiting.popleft()
            request.seq_len = hit
            self._active.append(request)
            self.stats.prompt_tokens += hit
            self.stats.prefix_hit_tokens += hit
            self.stats.requests[request.uid].prefix_hit_tokens = hit
            self.stats.blocks_in_use = self._paged.cache.blocks_in_use

    def _awaits_shared_blocks(self, request: _Request) -> bool:
        """Paged layout with prefix sharing: whether a prompt being fed now holds the next block
        of ``request``'s prompt that no cached block holds yet; it then waits for that block
        (cached as soon as it is written) instead of computing it again."""
        cache = self._paged.cache
        if not cache.prefix_sharing:
            return False
        hashes = self._block_names(request)
        cached = len(cache.cached_blocks(hashes))
        if cached == len(hashes):
            return False
        return any(hashes[cached] in self._block_names(r) for r in self._active if r.prefilling)

    def _block_names(self, request: _Request) -> list[int]:
        """The names of the full blocks of ``request``'s prompt but its last token."""
        if request.block_names is None:
            request.block_names = block_hashes(request.prompt[:-1], self._paged.cache.block_size)
        return request.block_names

    def step(self, sampler: Optional[Sampler] = None) -> StepResult:
        """One decode step for every active request, greedy unless ``sampler`` (or a request's
        own) says otherwise: one token each, or with a draft model one speculative round (1 to
        k + 1 tokens each)."""
        if self._waiting:
            self._admit_waiting()
        if not self._active:
            raise ValueError("[BatchedDecoder] step() needs at least one active request")
        return self._packed_step(sampler or Sampler())

    def _packed_step(self, sampler: Sampler) -> StepResult:
        """One packed step: every running request's decode tokens (1, or k + 1 with a draft
        model), then chunks of prompts first come first served, up to ``max_step_tokens``
        (decode tokens always run, past it too)."""
        start = time.perf_counter()
        k = 0 if self._draft is None else self.num_draft_tokens
        running = [not r.prefilling for r in self._active]
        budget = self.max_step_tokens - (k + 1) * sum(running)
        chunks: list[list[int]] = []
        for request in self._active:
            count = 0
            if request.prefilling and budget > 0:
                count = min(budget, self._chunk_limit, len(request.prompt) - request.seq_len)
                budget -= count
            chunks.append(request.prompt[request.seq_len : request.seq_len + count])
        # A prompt's first chunk, its last token aside: over a quantized cache it attends
        # itself unquantized, as mlx-lm's prefill does before it quantizes.
        first_chunks = [
            (row, min(len(chunk), len(r.prompt) - 1))
            for row, (r, chunk) in enumerate(zip(self._active, chunks))
            if r.seq_len == 0 and min(len(chunk), len(r.prompt) - 1) > 0
        ]
        # Requests whose chunk ends their prompt sample their first token.
        ending = [
            bool(chunk) and r.seq_len + len(chunk) == len(r.prompt)
            for r, chunk in zip(self._active, chunks)
        ]
        self.stats.prompt_tokens += sum(map(len, chunks))
        step = PackedRound(
            next_tokens=[r.next_token if run else None for r, run in zip(self._active, running)],
            chunks=chunks,
            ending=ending,
            seq_lens=[r.seq_len for r in self._active],
            first_chunks=first_chunks,
            samplers=[r.sampler or sampler for r in self._active],
            # Room for the longest prompt being fed at once: its chunks grow no cache.
            reserve_len=max((len(r.prompt) for r, c in zip(self._active, chunks) if c), default=0),
        )
        if self._draft is None:
            tokens, _, _ = packed_round(self._target, None, step, 0)
        else:
            tokens, drafted, accepted = packed_round(self._target, self._draft, step, k)
            self.stats.draft_tokens += drafted
            self.stats.accepted_tokens += accepted
        proposals = []
        for row, (request, chunk, out) in enumerate(zip(self._active, chunks, tokens)):
            # Every token's keys/values but the last emitted one are now in the caches.
            request.seq_len += len(chunk) if chunk else len(out or ())
            if chunk and self._paged is not None and self._paged.cache.prefix_sharing:
                # Its prompt's full blocks written so far become cached prefixes at once.
                written = min(request.seq_len, len(request.prompt) - 1)
                full = written // self._paged.cache.block_size
                self._paged.register(request.uid, self._block_names(request)[:full])
            if out:
                proposals.append((row, (request, out)))
        return self._finish_step(proposals, start, fed_prompts=any(chunks))

    def _finish_step(self, proposals: list, start: float, fed_prompts: bool) -> StepResult:
        """Stop tokens and budgets over ``(row, (request, tokens))`` proposals, then the
        finished requests leave and the stats count the step (as prefill time when it
        ``fed_prompts``)."""
        emitted: dict[int, list[int]] = {}
        finished_rows = []
        for row, (request, tokens) in proposals:
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
        generated = sum(len(t) for t in emitted.values())
        self.stats.generated_tokens += generated
        if fed_prompts:
            self.stats.prefill_seconds += end - start
        else:
            self.stats.decode_seconds += end - start
            self.stats.decode_steps += 1
            self.stats.decode_step_tokens += generated
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
            self._waiting = deque(w for w in self._waiting if w.uid != uid)
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
