"""Key/value caches and the per-step decode contexts that index them.

``context`` (``BatchedDecodeContext``, the arrays a decode step derives from its lengths once),
``kv_cache`` (``ContiguousKVCache`` per request, ``SlotKVCache`` per batch), ``ring_kv_cache``
(``RingSlotKVCache``: a windowed layer's last R positions per request, in a ring),
``ring_step`` (the ring offsets a step derives once for the rings of one size),
``quantized_kv_cache`` (``QuantizedSlotKVCache``), ``block_tables`` / ``paged_kv_cache`` /
``block_allocator`` / ``prefix_hashes`` (the paged layout) and ``buffers`` (how the slot caches
grow and where their memory lives). Caches import only ``ops`` below them.
"""
