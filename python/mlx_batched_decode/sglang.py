"""The SGLang plug-in: SGLang's MLX backend decodes through ``ragged_decode_attention``.

::

    import mlx_batched_decode.sglang
    mlx_batched_decode.sglang.enable()   # or: with mlx_batched_decode.sglang.enabled(): ...
    # SGLang's MLX model runner now attends every batched decode step with the fused op

SGLang's MLX backend keeps one cache per request and layer (``ContiguousAttentionKVCache``, or
``WindowedAttentionKVCache`` on sliding-window layers). For every layer of every batched decode
step its ``MLXAttentionWrapper._batched_decode`` writes each request's new token, then slices
each cache, pads them to the longest, concatenates them into one batch, builds a mask and calls
``mx.fast.scaled_dot_product_attention``. While enabled, that attention is one
``ragged_decode_attention`` call on the requests' own buffers, read in place, with the lengths
of the step's ``BatchedDecodeContext`` and the layer's window, scale and sinks: no slice, pad,
concatenate or mask. Everything else of the step (projections, q/k norms, RoPE, also SGLang's
AOT RoPE kernel, the cache writes, the output gate, ``o_proj``) stays SGLang's; prefill does not
go through the method at all. No file of SGLang is edited: ``enable()`` replaces one method in
memory, ``disable()`` restores it (``patches``). ``stats()`` counts the calls by where they ran.
SGLang 0.5.23 is required. The plug-in's code lives in ``mlx_batched_decode.integrations.sglang``.
"""

from .integrations.sglang import (
    SGLANG_VERSION,
    PluginStats,
    disable,
    enable,
    enabled,
    is_enabled,
    stats,
)

__all__ = ["SGLANG_VERSION", "PluginStats", "disable", "enable", "enabled", "is_enabled", "stats"]
