"""Metal GPU captures of MLX work, to inspect kernels in Xcode's GPU debugger."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx


@contextlib.contextmanager
def metal_capture(path: str | os.PathLike) -> Iterator[Path]:
    """Record a Metal GPU capture (``.gputrace``) of the GPU work run inside the block.

    MLX is lazy: evaluate inside the block (``mx.eval(out)``) what should be
    captured; work pending from before the block is finished first and stays
    out of it. In the capture, the kernels of this package appear by name:
    ``batched_decode_attention_<dtype>_<D>`` (one dispatch per step and layer)
    and, for long contexts, ``batched_decode_attention_reduce_<dtype>_<D>``;
    their command buffers are labelled ``BatchedDecodeAttention``.

    Args:
        path: the capture to write; must end in ``.gputrace`` and not exist yet.

    Yields:
        The capture's path, for opening in Xcode (``open path``) afterwards.

    Raises:
        RuntimeError: without a Metal GPU (Linux, or an MLX build without
            Metal), where ``mx.metal.start_capture`` would silently record
            nothing; or when the process was started without
            ``MTL_CAPTURE_ENABLED=1``, which Metal requires for captures.
        ValueError: ``path`` does not end in ``.gputrace``.
        FileExistsError: ``path`` exists (Metal does not overwrite captures).
    """
    if not mx.metal.is_available():
        raise RuntimeError(
            "[metal_capture] Metal is not available: this machine or MLX build has no Metal GPU "
            "(GPU captures need Apple silicon and macOS), so nothing could be recorded."
        )
    path = Path(path)
    if path.suffix != ".gputrace":
        raise ValueError(f"[metal_capture] the capture path must end in .gputrace, got {path}")
    if path.exists():
        raise FileExistsError(f"[metal_capture] {path} exists; Metal does not overwrite captures")
    if os.environ.get("MTL_CAPTURE_ENABLED") != "1":
        raise RuntimeError(
            "[metal_capture] Metal records captures only when the process starts with "
            "MTL_CAPTURE_ENABLED=1 in its environment (e.g. MTL_CAPTURE_ENABLED=1 python ...)."
        )
    mx.synchronize()
    mx.metal.start_capture(str(path))
    try:
        yield path
    finally:
        mx.synchronize()
        mx.metal.stop_capture()
