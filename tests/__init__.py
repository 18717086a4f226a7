"""The test suite, a package mirroring ``mlx_batched_decode`` and ``csrc/``: ``python -m pytest -q``."""
