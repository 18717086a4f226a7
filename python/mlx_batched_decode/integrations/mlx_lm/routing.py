"""The attention mlx-lm's models call while the plug-in is enabled, and which calls the op serves.

mlx-lm's attention layers end with ``scaled_dot_product_attention(queries, keys, values,
cache=cache, scale=..., mask=mask, sinks=...)``, after ``cache.update_and_fetch`` wrote the step's
keys/values. ``DecodeRouter``, a ``families.standard.RoutedAttention``, takes that call's place
(its ``serve`` says which calls the op takes). A decode step of mlx-lm's batched generation
(one new token per request, ``L = 1``) on a left-padded ``BatchKVCache`` goes to
``batched_decode_attention`` with:

- ``keys``/``values``: the ``[B, H_kv, T, D]`` / ``[B, H_kv, T, Dv]`` views ``update_and_fetch``
  returned, read in place; ``T`` is the cache's ``_idx`` after the write, the same for every
  request. Values may have a head dim of their own (DeepSeek-V2 and MiniCPM3 keep keys of
  ``qk_nope + qk_rope`` and values of ``v_head_dim`` per head); the output is ``[..., Dv]``;
- ``valid_lens = T`` for every request (left padding: every request ends at ``T``);
- ``kv_starts = cache.left_padding``: request ``b``'s first valid key;
- ``window``: the ``window_size`` the model built the mask with (``MaskTag``), if any.

That is exactly the set of keys mlx-lm's decode mask (``create_causal_mask(1, offset=_idx,
left_padding=..., window_size=...)``) allows; the mask array is never read, so (being lazy)
it is never computed. A ``BatchRotatingKVCache`` (sliding-window layers) is served the same way
while its ring has not wrapped: its buffer then holds the positions in temporal order, ``T`` is
its ``_offset``, and the window is the model's ``window_size`` or the ring's ``max_size``.

Once the ring wraps (``rotated``), a decode write goes to slot ``_idx`` and advances ``_idx``, and
``update_and_fetch`` returns the whole ring of ``W = max_size`` slots. After the write, slot ``s``
holds the key of time index ``(s - _idx) mod W`` (``_temporal_order`` rolls by ``-_idx``; time
index ``W - 1`` is the new token), and request ``b``'s keys are the time indices at or past its
``left_padding`` (which mlx-lm lowers by one per write once rotated; it goes negative when every
slot holds a key of the request): one range in time order, two runs of slots. mlx-lm's rolled
mask allows exactly these (``make_mask`` drops the left padding by one for the coming write and
rolls by ``_idx + 1``), within the window. The op reads them in place with ``ring_offset = _idx
mod W``, ``valid_lens = W``, ``kv_starts = left_padding`` (the op clamps it at 0) and the same
window. Several tokens per request (prefill, ``_update_concat``) first put the ring back in
temporal order and keep ``max_size + L - 1`` positions: those calls, every other cache
(``KVCache`` of single-request generation, quantized caches, ...) and head dims the op does not
take (``Dv > 512`` or ``D > 576``; the op takes keys of 513 to 576 dims, as MLA's latent and
rope keys, since their values are then narrower) stay on mlx-lm's path. ``PluginStats`` counts
every call by where it ran.

A floating-point mask no ``make_mask`` built is a score term the model adds: MLA layers the
plug-in does not replace (``families.mla`` replaces DeepSeek-V3's and GLM-4.7-Flash's; e.g.
DeepSeek-V3.2's, Bailing's) pass their rope scores (``pe_scores``) that way, their cache holding
latent and rope keys in two arrays. The op takes no additive scores, so those calls stay on
mlx-lm's path (``additive_mask``).
Any other decode mask on a batch cache that its ``make_mask`` did not build (``None``, a bool
array), built for another length, or for a ring in another state (wrapped or not) than the
cache's, is an error: the plug-in would not know which keys it allows.

Gemma 2's attention soft-caps its scores by hand instead of calling this function;
``families.gemma2`` replaces it and asks the router's ``serve`` the same question for each of its
calls (with the op's ``softcap``), as the replaced MLA layers of ``families.mla`` do for their
decode steps.

Dimension legend: B = requests in the step, H_q = query heads, H_kv = key/value heads,
L = new tokens per request, T = key/value positions, D = head dimension of queries and keys,
Dv = head dimension of values, W = ring slots.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import mlx.core as mx

import mlx_batched_decode

from ...families.standard import RoutedAttention
from .mask_tags import MaskTags

PREFIX = "[mlx_batched_decode.mlx_lm]"
_OP_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
_MAX_HEAD_DIM = 512
# Keys may be this wide where values are narrower (MLA's 512-wide latent and 64 rope dims).
_MAX_KEY_HEAD_DIM = 576


@dataclass
class PluginStats:
    """Calls of mlx-lm's ``scaled_dot_product_attention`` and of Gemma 2's attention (one per
    layer and forward pass) since ``enable()``, by where they ran.

    Through ``batched_decode_attention``:
        batch_kv: decode steps on a ``BatchKVCache``.
        batch_rotating: decode steps on a ``BatchRotatingKVCache``, its ring wrapped or not.
        batch_rotating_wrapped: of ``batch_rotating``, those on a ring that had wrapped, read
            through ``ring_offset``.

    On mlx-lm's path, by design:
        rotating_wrapped: decode steps on a wrapped ring while enabled with
            ``wrapped_rings=False`` (0 otherwise).
        prefill: several tokens per request on a batch cache (prompt processing).
        unsupported_shape: head dims the op does not take (``Dv > 512`` or ``D > 576``).
        additive_mask: decode steps on a batch cache whose mask is a floating-point score term
            no ``make_mask`` built (the rope scores of MLA layers other than DeepSeek-V3's and
            GLM-4.7-Flash's, which ``families.mla`` serves).
        other: every other cache (single-request ``KVCache``, quantized, none, ...).
    """

    batch_kv: int = 0
    batch_rotating: int = 0
    batch_rotating_wrapped: int = 0
    rotating_wrapped: int = 0
    prefill: int = 0
    unsupported_shape: int = 0
    additive_mask: int = 0
    other: int = 0

    @property
    def served(self) -> int:
        """Calls that ran through ``batched_decode_attention``."""
        return self.batch_kv + self.batch_rotating


class OpCall(NamedTuple):
    """What one served call passes to ``batched_decode_attention`` besides the arrays."""

    valid_lens: mx.array
    kv_starts: mx.array
    window: Optional[int]
    ring_offset: Optional[mx.array]


def _op_takes(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether ``batched_decode_attention`` takes queries ``[B, H_q, L, D]``, keys
    ``[B, H_kv, T, D]`` and values ``[B, H_kv, T, Dv]`` of these shapes and dtypes."""
    head_dim, value_dim = keys.shape[-1], values.shape[-1]
    return (
        keys.shape[:3] == values.shape[:3]
        and head_dim == queries.shape[-1]
        and 1 <= value_dim <= _MAX_HEAD_DIM
        # Values being at most 512 wide, keys past 512 come with narrower ones, as the op needs.
        and head_dim <= _MAX_KEY_HEAD_DIM
        and queries.dtype in _OP_DTYPES
        and keys.dtype == queries.dtype
        and values.dtype == queries.dtype
    )


class DecodeRouter(RoutedAttention):
    """The plug-in's drop-in for mlx-lm's ``scaled_dot_product_attention`` (same signature).

    Args:
        original: mlx-lm's own function, which every call the op does not serve goes to.
        tags: where the patched ``make_mask`` methods record their decode masks.
        batch_kv: mlx-lm's ``BatchKVCache`` class.
        batch_rotating: mlx-lm's ``BatchRotatingKVCache`` class.
        wrapped_rings: serve decode steps on wrapped rings (``False`` leaves them to mlx-lm, as
            the plug-in did before it read rings: a baseline for comparison).
    """

    def __init__(
        self,
        original: Callable,
        tags: MaskTags,
        batch_kv: type,
        batch_rotating: type,
        wrapped_rings: bool = True,
    ) -> None:
        super().__init__(original, PREFIX)
        self.tags = tags
        self.batch_kv = batch_kv
        self.batch_rotating = batch_rotating
        self.wrapped_rings = wrapped_rings
        self.stats = PluginStats()
        self._local = threading.local()

    def serve(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Optional[mx.array] = None,
        softcap: Optional[float] = None,
    ) -> Optional[mx.array]:
        """As ``RoutedAttention.serve``: ``batched_decode_attention`` for the calls ``plan``
        takes, ``None`` for the rest; ``mask`` as mlx-lm passes it (an array, ``"causal"`` or
        ``None``)."""
        call = self.plan(queries, keys, values, cache, mask)
        if call is None:
            return None
        return mlx_batched_decode.batched_decode_attention(
            queries,
            keys,
            values,
            call.valid_lens,
            scale=scale,
            kv_starts=call.kv_starts,
            window=call.window,
            sinks=sinks,
            ring_offset=call.ring_offset,
            softcap=softcap,
        )

    def plan(
        self, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, mask: Any
    ) -> Optional[OpCall]:
        """The op's arguments for this call, or ``None`` for mlx-lm's path (counted in
        ``stats`` either way); arguments as ``serve``'s."""
        stats = self.stats
        rotating = isinstance(cache, self.batch_rotating)
        if not (rotating or isinstance(cache, self.batch_kv)):
            stats.other += 1
            return None
        if queries.shape[2] != 1:
            stats.prefill += 1
            return None
        if not _op_takes(queries, keys, values):
            stats.unsupported_shape += 1
            return None
        tag = self.tags.get(mask)
        name = type(cache).__name__
        if tag is None and isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating):
            stats.additive_mask += 1
            return None
        if tag is None:
            got = "None" if mask is None else f"a {type(mask).__name__} it did not build"
            raise ValueError(
                f"{PREFIX} a decode step attends a {name} with a mask its make_mask did not "
                f"build (got {got}): this model builds its decode masks some other way, so the "
                "plug-in cannot tell which keys they allow; call "
                "mlx_batched_decode.mlx_lm.disable() to run it"
            )
        if tag.kind is not type(cache):
            raise ValueError(
                f"{PREFIX} a layer's {name} got a decode mask built by a {tag.kind.__name__}: "
                "the plug-in reads a mask's keys from the cache kind that built it"
            )
        # Positions the cache holds after the step's write, which its mask was built for.
        held = cache._offset if rotating else cache._idx
        if held != tag.length + 1:
            raise ValueError(
                f"{PREFIX} a layer's {name} holds {held} positions after the step's write but "
                f"its decode mask was built for {tag.length + 1}"
            )
        ring_offset = None
        if rotating:
            if tag.wrapped != cache.rotated:
                state = ("wrapped", "had not") if cache.rotated else ("not wrapped", "had")
                raise ValueError(
                    f"{PREFIX} a layer's BatchRotatingKVCache has {state[0]} but its decode mask "
                    f"was built for a ring that {state[1]}"
                )
            if cache.rotated and not self.wrapped_rings:
                stats.rotating_wrapped += 1
                return None
            # A wrapped ring returns all its slots; one that has not, its positions in order.
            slots = cache.max_size if cache.rotated else cache._offset
            window = cache.max_size if tag.window is None else tag.window
            if cache.rotated:
                ring_offset = self._filled(queries.shape[0], cache._idx % cache.max_size)
        else:
            slots = cache._idx
            window = tag.window
        if keys.shape[2] != slots:
            raise ValueError(
                f"{PREFIX} a layer's {name} returned {keys.shape[2]} keys but holds {slots} slots"
            )
        if rotating:
            stats.batch_rotating += 1
            if ring_offset is not None:
                stats.batch_rotating_wrapped += 1
        else:
            stats.batch_kv += 1
        lens = self._filled(queries.shape[0], slots)
        return OpCall(lens, cache.left_padding, window, ring_offset)

    def _filled(self, batch: int, value: int) -> mx.array:
        """int32 ``[B]`` filled with ``value``: made once per (B, value) and thread, shared by
        every layer of a step (a left-padded batch ends every request at the same position, and
        the layers of one kind share their ring's offset)."""
        made = getattr(self._local, "made", None)
        if made is None or len(made) > 16:
            made = self._local.made = {}
        filled = made.get((batch, value))
        if filled is None:
            filled = made[(batch, value)] = mx.full((batch,), value, dtype=mx.int32)
        return filled
