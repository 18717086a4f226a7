"""References of the quantized decoder tests where mlx-lm's quantized cache has none (sliding
windows, sinks, multi-head latent attention): the dense decoder fed the dequantized keys and
values, and mlx-lm's own cache storing them dequantized; and the comparison of greedy tokens
with a quantized reference, which lets near ties go either way (``assert_tokens_match``)."""

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from mlx_lm.models.cache import KVCache

from mlx_batched_decode.attention.ring import RingSlotAttention
from mlx_batched_decode.attention.slot import SlotAttention, attend_first_chunks
from mlx_batched_decode.caches.kv_cache import SlotKVCache
from mlx_batched_decode.caches.ring_kv_cache import RingSlotKVCache
from mlx_batched_decode.decoding.decoder import BatchedDecoder
from mlx_batched_decode.decoding.sampling import Sampler

# The widest gap between a reference's two best logits at which a quantized run may pick the
# other one. Two runs whose keys differ by rounding (1e-6) round a few elements to neighbouring
# integers, which moved logits by up to 2e-3 (Gemma 3, 8 bits, measured).
NEAR_TIE = 5e-3


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


def top_two(logits: mx.array) -> tuple[tuple[int, float], tuple[int, float]]:
    """The two best (token, logit) of ``logits [V]``, best first."""
    order = mx.argsort(logits.astype(mx.float32))[::-1][:2].tolist()
    return tuple((token, logits[token].item()) for token in order)


def assert_tokens_match(out, want, reference_top_two) -> None:
    """``out`` equals ``want`` request by request, but where a request parts from the reference
    at a near tie: the reference's two best tokens there are ``out``'s and ``want``'s, within
    ``NEAR_TIE``; after that its tokens are not compared. ``reference_top_two(request, prefix)``:
    the reference's ``top_two`` after request ``request``'s prompt and the tokens ``prefix``."""
    for request, (ours, theirs) in enumerate(zip(out, want)):
        assert len(ours) == len(theirs), (request, ours, theirs)
        parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if parted is None:
            continue
        (best, best_logit), (second, second_logit) = reference_top_two(request, theirs[:parted])
        assert {ours[parted], theirs[parted]} == {best, second}, (request, parted, ours, theirs)
        assert best_logit - second_logit < NEAR_TIE, (request, parted, best_logit - second_logit)


class _Recorder(Sampler):
    """Greedy, keeping the last logits it chose from."""

    def __call__(self, logits):
        self.logits = logits
        return super().__call__(logits)


def dense_top_two(model, prompts, bits, group_size, monkeypatch, **options):
    """``reference_top_two`` of ``dequantized_reference``: the dense decoder over
    ``dequantized_dense_caches`` fed one request's prompt and prefix (``options``: the
    decoder's)."""

    def top(request, prefix):
        with dequantized_dense_caches(bits, group_size, monkeypatch):
            decoder = BatchedDecoder(model, **options)
            recorder = _Recorder()
            decoder.add_request(list(prompts[request]) + list(prefix), 1, sampler=recorder)
            while decoder.num_active:
                decoder.step()
        return top_two(recorder.logits[0])

    return top


def mlx_lm_top_two(model, prompts, **options):
    """``reference_top_two`` of mlx-lm's ``generate_step`` (``options``: its keywords; a
    ``prompt_cache`` factory as ``caches``, called once per request)."""
    from mlx_lm.generate import generate_step

    def top(request, prefix):
        kwargs = dict(options)
        caches = kwargs.pop("caches", None)
        if caches is not None:
            kwargs["prompt_cache"] = caches()
        tokens = mx.array(list(prompts[request]) + list(prefix))
        (_, logprobs), = generate_step(tokens, model, max_tokens=1, **kwargs)
        return top_two(logprobs)

    return top
