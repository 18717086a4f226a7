"""Decoding unchanged mlx-lm models through the attention paths, with continuous batching.

``decoder`` (``BatchedDecoder``, the scheduler; ``StepResult``), ``decode_stats``
(``DecodeStats``, ``RequestTiming``), ``served_model`` / ``paged_served_model`` (one model's
prefill, forward passes and K/V rows, slot or paged layout), ``mlx_lm_caches`` (mlx-lm's own
caches for a model: prompts, layer windows), ``speculative`` (one draft-and-verify round) and
``sampling`` (``Sampler``). A model's attention reaches a ``DecodeAttention`` through
``families`` (``step_forward.routed_forward``).
"""
