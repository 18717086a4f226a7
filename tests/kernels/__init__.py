"""Kernel tests, by backend: ``cpu`` (the C++ kernel) and ``metal`` (emulated, or on a GPU)."""
