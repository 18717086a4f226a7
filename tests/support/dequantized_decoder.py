"""References of the quantized decoder tests where mlx-lm's quantized cache has none (sliding
windows, sinks, multi-head latent attention): the dense decoder fed the dequantized keys and
values, and mlx-lm's own cache storing them dequantized."""

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from mlx_lm.models.cache import KVCache

from mlx_batched_decode.attention.ring import RingSlotAttention
from mlx_batched_decode.attention.slot import SlotAttention, attend_first_chunks
from mlx_batched_decode.caches.kv_cache import SlotKVCache
from mlx_batched_decode.caches.ring_kv_cache import RingSlotKVCache
from mlx_batched_decode.decoding.decoder import BatchedDecoder


def rounded(x: mx.array, bits: int, group_size: int) -> mx.array:
    """``mx.dequantize(mx.quantize(x))``: what a quantized cache gives back of ``x``."""
    triple = mx.quantize(x, group_size=group_size, bits=bits)
    return mx.dequantize(*triple, group_size=group_size, bits=bits)


class RoundedKVCache(KVCache):
    """mlx-lm's ``KVCache`` keeping what ``generate_step(kv_bits=..., quantized_kv_start=0)``
    keeps: every key/value rounded (``rounded``), the first call (the first prefill chunk)
    attending its own unrounded, before mlx-lm quantizes the cache. For a model whose layers
    mlx-lm's ``QuantizedKVCache`` cannot run (multi-head latent attention)."""

    def __init__(self, bits: int, group_size: int):
        super().__init__()
        # Not `bits` / `group_size`: mlx-lm reads those as a quantized cache's.
        self.rounding = (bits, group_size)

    def update_and_fetch(self, keys, values):
        first = self.offset == 0
        all_keys, all_values = super().update_and_fetch(
            rounded(keys, *self.rounding), rounded(values, *self.rounding)
        )
        return (keys, values) if first else (all_keys, all_values)


@contextmanager
def dequantized_dense_caches(bits, group_size, monkeypatch) -> Iterator[None]:
    """While active, the dense slot and ring caches store every key/value written as
    ``mx.dequantize(mx.quantize(.))``, and a prompt's first chunk attends its own keys/values
    unrounded as over a quantized cache: plain MLX and the dense op, no quantized kernel."""

    def kept(x):
        # None: an MLA layer's cache keeps keys only.
        return None if x is None else rounded(x, bits, group_size)

    with monkeypatch.context() as patch:
        # Full-attention layers' slot caches and sliding-window layers' rings alike.
        for cache_class in (SlotKVCache, RingSlotKVCache):
            real_update, real_write = cache_class.update, cache_class.write_prompt
            patch.setattr(
                cache_class,
                "update",
                lambda c, k, v, ctx, real=real_update: real(c, kept(k), kept(v), ctx),
            )
            patch.setattr(
                cache_class,
                "write_prompt",
                lambda c, slot, k, v, real=real_write: real(c, slot, kept(k), kept(v)),
            )
        for attention_class in (SlotAttention, RingSlotAttention):
            real_attend = attention_class.attend
            patch.setattr(
                attention_class,
                "attend",
                lambda a, ctx, q, k, v, *, new_keys_values=None, real=real_attend, **options: (
                    attend_first_chunks(real(a, ctx, q, k, v, **options), ctx, q, new_keys_values,
                                        options)
                ),
            )
        yield


def dequantized_reference(model, prompts, budgets, bits, group_size, monkeypatch):
    """The greedy tokens of the dense slot decoder over ``dequantized_dense_caches``."""
    with dequantized_dense_caches(bits, group_size, monkeypatch):
        # Chunks of the window (16): the dense decoder's rings take no more, so both decoders
        # cut the prompts alike.
        decoder = BatchedDecoder(model, kv_step=16, max_step_tokens=16)
        return decoder.generate(prompts, budgets, max_batch_size=3)
