"""The attention wrappers a model's attention layer calls once per layer in a decode step.

Paths with one interface (``base.DecodeAttention``):

- ``SlotAttention`` (default): every request's new K/V goes into the layer's ``SlotKVCache`` with
  one scatter, and ``batched_decode_attention`` reads ``buffer[:B, :, :max_len]`` in place with
  the context's ``valid_lens``, the layer's window and sinks. No pad, no concatenate, no mask.
- ``QuantizedSlotAttention``: the same over a ``QuantizedSlotKVCache`` (mlx-lm's 8- or 4-bit
  ``mx.quantize`` triples): the new K/V are quantized once and scattered, and
  ``quantized_batched_decode_attention`` reads the triples of views in place.
- ``RingSlotAttention``: a sliding-window layer's zero-copy path over a ``RingSlotKVCache``, which
  keeps each request's last R positions at ring slots ``p mod R`` (memory in proportion to the
  window); ``batched_decode_attention`` reads the ring in place through the step's ring offsets.
- ``PagedAttention``: new K/V scattered into the block pools of a ``PagedKVCache`` and
  ``paged_decode_attention`` reading them through the step's block tables (``paged``).
- ``SeedAttention``: the seed design of DESIGN.md section 1, kept as the baseline: per-request
  ``ContiguousKVCache``, right padding to ``max_len``, concatenation into one batch, an additive
  mask rebuilt per layer, ``mx.fast.scaled_dot_product_attention``.

All serve L >= 1 new tokens per request (row ``i`` of request ``b`` sits at position
``p = seq_lens[b] + i`` and attends keys ``max(p - window + 1, 0) .. p``), sliding-window layers
(``window``, the number of keys a row attends, itself included) and attention sinks (``sinks``,
a per-head logit in the softmax denominator, as ``mx.fast.scaled_dot_product_attention``).

Dimension legend: B = requests in the step, L = new tokens per request, H_q = query heads,
H_kv = key/value heads, T = key/value positions, D = head dimension.
"""
