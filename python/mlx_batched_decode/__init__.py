"""Padded, masked, batched decode attention for MLX.

``batched_decode_attention`` attends the new tokens of each request (one, or
several when a target model verifies draft tokens) over that request's own
cached keys, within an optional sliding window and with optional attention
sinks, in one fused kernel (C++ on the CPU, Metal on Apple GPUs), reading
strided cache views in place. ``BatchedDecoder`` runs unchanged mlx-lm models
through it with continuous batching and, given a draft model, speculatively.
``mlx_batched_decode.mlx_lm.enable()`` makes mlx-lm's own batched generation (and
``mlx_lm.server``, as ``python -m mlx_batched_decode.serve``) decode through it.
"""

import mlx.core  # noqa: F401  registers MLX's types before the extension loads

from . import _ext
from ._ext import (
    advise_huge_pages,
    batched_decode_attention,
    metal_backend,
    metal_source,
    paged_decode_attention,
    quantized_batched_decode_attention,
    reference_attention,
    reference_paged_attention,
)

# A malformed MBD_CPU_SPIN_US is refused here, not inside the first kernel call.
_ext.cpu_spin_us()

__all__ = [
    "advise_huge_pages",
    "batched_decode_attention",
    "metal_backend",
    "metal_source",
    "paged_decode_attention",
    "quantized_batched_decode_attention",
    "reference_attention",
    "reference_paged_attention",
]

# The decode layer (issue 4): per-step context, KV caches, attention paths, mlx-lm adapter,
# speculative decoding.
# None of these imports mlx-lm at import time; it is needed only to run a BatchedDecoder.
from .attention import DecodeAttention, QuantizedSlotAttention, SeedAttention, SlotAttention
from .block_allocator import BlockAllocator, BlockBudgetError
from .context import BatchedDecodeContext
from .decoder import BatchedDecoder, DecodeStats, StepResult
from .kv_cache import ContiguousKVCache, SlotKVCache
from .paged_attention import PagedAttention
from .paged_context import PagedDecodeContext
from .paged_kv_cache import PagedKVCache
from .quantized_kv_cache import QuantizedSlotKVCache
from .sampling import Sampler

__all__ += [
    "BatchedDecodeContext",
    "BatchedDecoder",
    "BlockAllocator",
    "BlockBudgetError",
    "ContiguousKVCache",
    "DecodeAttention",
    "DecodeStats",
    "PagedAttention",
    "PagedDecodeContext",
    "PagedKVCache",
    "QuantizedSlotAttention",
    "QuantizedSlotKVCache",
    "Sampler",
    "SeedAttention",
    "SlotAttention",
    "SlotKVCache",
    "StepResult",
]
