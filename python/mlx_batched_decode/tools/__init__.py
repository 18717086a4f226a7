"""Leaf utilities any layer may use: ``profiling`` (Metal captures), ``progress`` (a terminal
bar), ``random_model`` / ``model_folder`` (random-weight mlx-lm models, in memory or as a model
folder) and ``local_server`` (start a server process and wait until it is healthy). They import
nothing of the package above ``ops``."""
