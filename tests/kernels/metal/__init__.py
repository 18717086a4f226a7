"""The Metal kernels: emulated on the CPU (``tests.metal_emu``), compiled, or on a GPU."""
