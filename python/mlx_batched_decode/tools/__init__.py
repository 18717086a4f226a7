"""Leaf utilities any layer may use: ``profiling`` (Metal captures), ``progress`` (a terminal
bar), ``timing`` (medians of calls timed in turns), ``bandwidth`` (read-bandwidth probes of the
CPU and the GPU), ``random_model`` / ``model_folder`` (random-weight mlx-lm models, in memory or
as a model folder), ``local_server`` (start a server process and wait until it is healthy) and
``selftest`` (the self-test behind ``python -m mlx_batched_decode.selftest``). They import
nothing of the package above ``ops``."""
