"""Each model family's attention, shared by the decoder and the mlx-lm plug-in.

``standard`` (layers that call mlx-lm's ``scaled_dot_product_attention``, windows and sinks:
``RoutedAttention``, the drop-in both route it with), ``mla`` (multi-head latent attention in
latent space: ``LatentSpec``, ``latent_specs``, the rope identity, the latent queries, the
plug-in's ``__call__``), ``gemma2`` (Gemma 2's projections and soft-capped attention: one
``__call__`` for both), ``patches`` (what is replaced in mlx-lm for the decoder's steps and
for the plug-in; ``apply``/``undo``), ``step_cache`` (``StepLayerCache``, the cache each layer
sees in a decoder step, and ``StepAttention``, its router) and ``step_forward``
(``routed_forward``: one packed step's forward pass). The decoding layer imports
``routed_forward`` from ``step_forward``, ``mlx_lm_attention_modules`` from ``patches`` and
``LatentSpec``/``latent_specs`` from ``mla``. mlx-lm is imported lazily, inside functions.
"""
