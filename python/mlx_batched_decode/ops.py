"""The fused ops of the extension and their references, as the rest of the package uses them.

``batched_decode_attention`` (dense per-request caches), ``paged_decode_attention`` (block pools
read through block tables), ``quantized_batched_decode_attention`` (mlx-lm's ``mx.quantize``
triples) and ``ragged_decode_attention`` (one buffer per request, as SGLang's MLX backend keeps
them) attend the new tokens of each request over its own cached keys in one kernel;
``reference_attention``, ``reference_paged_attention`` and ``reference_ragged_attention`` compute
the same from plain MLX ops. ``advise_huge_pages`` places a cache buffer on transparent huge pages (Linux),
``metal_source`` and ``metal_backend`` tell which Metal kernels the build holds and serves.
Their docstrings give the shapes, dtypes and dimension names.
"""

import mlx.core  # noqa: F401  registers MLX's types before the extension loads

from ._ext import (
    advise_huge_pages,
    batched_decode_attention,
    metal_backend,
    metal_source,
    paged_decode_attention,
    quantized_batched_decode_attention,
    ragged_decode_attention,
    reference_attention,
    reference_paged_attention,
    reference_ragged_attention,
)

__all__ = [
    "advise_huge_pages",
    "batched_decode_attention",
    "metal_backend",
    "metal_source",
    "paged_decode_attention",
    "quantized_batched_decode_attention",
    "ragged_decode_attention",
    "reference_attention",
    "reference_paged_attention",
    "reference_ragged_attention",
]
