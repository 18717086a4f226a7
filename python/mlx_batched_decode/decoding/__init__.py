"""The engine: unchanged mlx-lm models decoded through the attention paths, continuously batched.

The parts, each one job (vLLM V1's engine core, in this project's words):

- ``scheduler`` (``Scheduler``): the requests (``request``: status, finish reason), the waiting
  queue and the running rows, ``max_batch_size``, the token budget, admission against the KV
  layout; plans a step (``plan``: ``StepPlan``) and applies what it produced (``StepResult``).
- ``runner`` (``ModelRunner``): executes a plan: the row changes on the layouts, one context and
  forward pass, one batched sampling pass (``sampling``); ``speculative``, its draft-and-verify
  strategy; ``packing``, a step's token array.
- ``layouts`` (``KVLayout``: slot with rings and quantized caches, paged with prefix sharing, the
  seed baseline): admit, free, each layer's cache and attention, the step's context, usage.
- ``config``: the checked dataclasses (``CacheConfig``, ``SchedulerConfig``,
  ``SpeculativeConfig``, ``EngineConfig``) and the flags generated from them.
- ``engine_core`` (``EngineCore``): the parts stepped together, the server's interface.
- ``decoder`` (``BatchedDecoder``): the facade with ``generate`` and ``DecodeStats``
  (``decode_stats``).
- ``mlx_lm_caches``: mlx-lm's own caches for a model (which layers it serves, their windows).

A model's attention reaches the layouts' ``DecodeAttention`` through ``families``
(``step_forward.routed_forward``).
"""
