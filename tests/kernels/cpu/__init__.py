"""The C++ CPU kernel: tiles, ISA variants, threads, huge pages, sanitizers."""
