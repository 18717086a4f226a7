"""The self-test a user runs first, ``python -m mlx_batched_decode.selftest [--quick]``.

``cases`` (the grid), ``layouts`` (each op's inputs built from one float32 truth), ``compare``
(errors and tolerances), ``speed`` (the timed line per op), ``report`` (what is printed) and
``main`` (the command). Everything runs on the default device; the reference on the CPU.
"""
