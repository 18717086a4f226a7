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

from . import _ext, ops
from .ops import *  # noqa: F403  the fused ops and their references: ops.__all__

# A malformed MBD_CPU_SPIN_US is refused here, not inside the first kernel call.
_ext.cpu_spin_us()

__all__ = list(ops.__all__)

# The decode layer: per-step contexts, KV caches, attention paths, the engine core (configs,
# plans, results) and the decoder over mlx-lm models. None of these imports mlx-lm at import
# time; it is needed only to run a BatchedDecoder.
from .attention.base import DecodeAttention
from .attention.paged import PagedAttention
from .attention.ring import RingSlotAttention
from .attention.seed import SeedAttention
from .attention.slot import QuantizedSlotAttention, SlotAttention
from .caches.block_allocator import BlockAllocator, BlockBudgetError
from .caches.context import BatchedDecodeContext
from .caches.kv_cache import ContiguousKVCache, SlotKVCache
from .caches.paged_kv_cache import PagedKVCache
from .caches.quantized_kv_cache import QuantizedSlotKVCache
from .caches.ring_kv_cache import RingSlotKVCache
from .decoding.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from .decoding.decode_stats import DecodeStats, RequestTiming
from .decoding.decoder import BatchedDecoder
from .decoding.engine_core import EngineCore
from .decoding.plan import Snapshot, StepPlan, StepResult
from .decoding.request import FinishReason
from .decoding.sampling import Sampler

__all__ += [
    "BatchedDecodeContext",
    "BatchedDecoder",
    "BlockAllocator",
    "BlockBudgetError",
    "CacheConfig",
    "ContiguousKVCache",
    "DecodeAttention",
    "DecodeStats",
    "EngineConfig",
    "EngineCore",
    "FinishReason",
    "PagedAttention",
    "PagedKVCache",
    "QuantizedSlotAttention",
    "QuantizedSlotKVCache",
    "RequestTiming",
    "RingSlotAttention",
    "RingSlotKVCache",
    "Sampler",
    "SchedulerConfig",
    "SeedAttention",
    "SlotAttention",
    "SlotKVCache",
    "Snapshot",
    "SpeculativeConfig",
    "StepPlan",
    "StepResult",
]
