"""A driver of SGLang's MLX attention wrappers, written after ``MlxModelRunner`` (SGLang 0.5.23,
``hardware_backend/mlx/model_runner.py``), whose module imports torch and so cannot run here.

It does what the runner does around ``MLXAttentionWrapper`` with SGLang's own functions:
``patch_model_attention`` wraps the model's attention layers, ``MlxModelCacheLayout`` says which
layers slide; each request gets one cache per layer (``WindowedAttentionKVCache`` on sliding
layers, ``ContiguousAttentionKVCache`` elsewhere, whose capacity doubles when full) and is
prefilled alone through the model with that cache list; a decode step builds one
``BatchedDecodeContext`` with ``BatchedDecodeContext.from_decode``, sets it, runs the model on the
step's ``[B, 1]`` tokens with ``AttentionOffsetCache`` shims (so every wrapper takes its
``_batched_decode``), clears it and takes the greedy tokens. Requests join at chosen steps and
leave when their budget is spent.

Dimension legend: B requests in a step, V vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn


@dataclass
class AOTRoPE:
    """What a decode step needs for SGLang's AOT RoPE path (``ctx.aot.rope``): the kernel set,
    the shared pool of full-attention layers it scatters into, and the request-to-slot table
    (``req_to_token[pool_index, position]``: the pool slot of a request's token)."""

    kernels: Any
    kv_pool: Any
    req_to_token: Any
    pool_index: dict[str, int] = field(default_factory=dict)


def cache_arrays(caches: Sequence[Sequence[Any]]) -> list[mx.array]:
    """Every array the requests' caches hold (``state`` of each), for ``mx.eval``."""
    return [a for layers in caches for cache in layers for a in cache.state]


class SGLangRunner:
    """Greedy batched decoding of an mlx-lm model through SGLang's attention wrappers.

    Args:
        model: an mlx-lm model; its attention layers get wrapped (once, idempotently).
        backend: the modules of ``tests.support.sglang_backend.load_backend()``.
        max_seq_len: the first capacity of each ``ContiguousAttentionKVCache``.
        aot: SGLang's AOT RoPE state; ``None``: the decode steps use ``inner.rope``.
    """

    def __init__(
        self,
        model: nn.Module,
        backend: SimpleNamespace,
        max_seq_len: int = 4096,
        aot: Optional[AOTRoPE] = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.max_seq_len = max_seq_len
        self.aot = aot
        patching = backend.model_patching
        patching.patch_model_attention(model)
        layers, attrs = patching.find_attention_layers(model)
        windows = backend.attention_contract.get_layer_window_sizes(model)
        self.layout = backend.layout.MlxModelCacheLayout.from_attention_discovery(
            layers, attrs, layer_window_sizes=windows
        )
        self.decode_steps = 0
        # ContiguousAttentionKVCache buffers that grew during a decode step (requests x layers).
        self.decode_growths = 0

    def new_cache(self) -> list[Any]:
        """One request's caches, one per layer, as ``MlxModelRunner._new_native_cache`` makes."""
        kv = self.backend.attention_kv_cache
        cache = []
        for layer in range(self.layout.num_layers):
            window = self.layout.window_size(layer)
            if window is None:
                cache.append(kv.ContiguousAttentionKVCache(max_seq_len=self.max_seq_len))
            else:
                cache.append(kv.WindowedAttentionKVCache(window))
        return cache

    def prefill(self, prompt: Sequence[int]) -> tuple[list[Any], int]:
        """A new request's caches after its prompt, and its first greedy token."""
        cache = self.new_cache()
        logits = self.model(mx.array([list(prompt)], dtype=mx.int32), cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token, *cache_arrays([cache]))
        return cache, token.item()

    def context(self, caches: list[list[Any]], req_ids: list[str]) -> Any:
        """The step's ``BatchedDecodeContext``, built as ``_build_batched_decode_context`` does."""
        wrapper = self.backend.attention_wrapper
        layout = self.layout
        aot = self.aot
        # SGLang's ReqToTokenPool holds a torch tensor there; from_decode only indexes it.
        req_to_token = None if aot is None else SimpleNamespace(req_to_token=aot.req_to_token)
        return wrapper.BatchedDecodeContext.from_decode(
            caches=caches,
            req_ids=req_ids,
            aot_kernels=self.backend.aot.MlxAOTKernelSet() if aot is None else aot.kernels,
            kv_pool=None if aot is None else aot.kv_pool,
            req_pool_idx={} if aot is None else aot.pool_index,
            req_to_token_pool=req_to_token,
            attention_layer_indices=list(layout.attention_layer_indices),
            attention_pool_index_by_layer=layout.attention_pool_index_by_layer,
            full_kv_pool_index_by_layer=layout.full_kv_pool_index_by_layer,
        )

    def forward(self, caches: list[list[Any]], tokens: mx.array, req_ids: list[str]) -> mx.array:
        """``[B, V]`` last-token logits of one decode step (lazy), as
        ``_decode_with_batched_attention`` computes them; ``tokens``: int32 ``[B, 1]``."""
        wrapper = self.backend.attention_wrapper
        ctx = self.context(caches, req_ids)
        wrapper.set_context(ctx)
        try:
            shims = [
                self.backend.attention_kv_cache.AttentionOffsetCache(offset=max(ctx.seq_lens))
                for _ in range(self.layout.num_layers)
            ]
            return self.model(tokens, cache=shims)[:, -1, :]
        finally:
            wrapper.clear_context()

    def step(self, caches: list[list[Any]], tokens: list[int], req_ids: list[str]) -> list[int]:
        """One greedy decode step of the requests whose caches and last tokens are given."""
        before = self._capacities(caches)
        logits = self.forward(caches, mx.array(tokens, dtype=mx.int32)[:, None], req_ids)
        next_tokens = mx.argmax(logits, axis=-1)
        mx.eval(next_tokens, *cache_arrays(caches))
        after = self._capacities(caches)
        self.decode_growths += sum(a > b for a, b in zip(after, before))
        self.decode_steps += 1
        return next_tokens.tolist()

    def _capacities(self, caches: list[list[Any]]) -> list[int]:
        contiguous = self.backend.attention_kv_cache.ContiguousAttentionKVCache
        return [c.max_seq_len for layers in caches for c in layers if isinstance(c, contiguous)]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        join_at: Sequence[int],
    ) -> list[list[int]]:
        """Every request's greedy tokens (its prefill's first, then one per decode step).

        Request ``i`` is prefilled before decode step ``join_at[i]`` and decodes with whoever
        is active then, until it has ``max_tokens[i]`` tokens.
        """
        out: list[list[int]] = [[] for _ in prompts]
        caches: dict[int, list[Any]] = {}
        step = 0
        while len(caches) or step <= max(join_at):
            for i, joins in enumerate(join_at):
                if joins == step:
                    caches[i], token = self.prefill(prompts[i])
                    out[i].append(token)
                    if len(out[i]) >= max_tokens[i]:
                        del caches[i]
            active = list(caches)
            if active:
                last = [out[i][-1] for i in active]
                tokens = self.step([caches[i] for i in active], last, [str(i) for i in active])
                for i, token in zip(active, tokens):
                    out[i].append(token)
                    if len(out[i]) >= max_tokens[i]:
                        del caches[i]
            step += 1
        return out
