"""Decoding unchanged mlx-lm models through the attention paths, with continuous batching.

``decoder`` (``BatchedDecoder``, the scheduler; ``StepResult``), ``decode_stats``
(``DecodeStats``, ``RequestTiming``), ``served_model`` / ``paged_served_model`` (one model's
prefill, forward passes and K/V rows, slot or paged layout), ``prefill`` (prompts through
mlx-lm's own caches), ``model_adapter`` (routes an mlx-lm model's attention modules to a
``DecodeAttention``), ``speculative`` (one draft-and-verify round) and ``sampling`` (``Sampler``).
"""
