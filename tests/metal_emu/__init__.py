"""Metal emulation harness: runs the project's unedited ``.metal`` kernels on the CPU.

No tool compiles MSL on Linux, so the kernel source is translated and compiled
as C++20 by g++ and executed lane by lane:

- cmake/metal_source.py, the generator of the source ``_ext`` embeds
  (``mlx_batched_decode.metal_source()``), first inlines the quoted includes
  (keeping ``#line``s), so the harness compiles that very text;
- ``prepass.py`` gives built-in parameters the running lane's values, makes
  ``threadgroup`` variables ``static``, reads function constants from the
  launch and registers each ``[[host_name]]`` instantiation;
- ``metal_emu.h`` (through the stub ``include/metal_stdlib``) makes the rest of
  MSL parse: address spaces, vector types, ``half``/``bfloat``, math, simd
  collectives and barriers;
- ``runtime.cpp`` runs the lanes of a threadgroup as fibers (deterministic) or
  OS threads (for ThreadSanitizer); every collective is a rendezvous that
  reports, with ``.metal`` source lines, mismatched collectives, collectives
  reached by only some lanes and skipped barriers; threadgroup memory is
  filled with NaN before each threadgroup; in ThreadSanitizer builds the
  vector types assign element by element (``emu_vec.h``), since g++ leaves
  unchecked a call's vector result stored straight into memory;
- ``launcher.cpp`` dispatches with ``csrc/metal/launch_plan.h`` (and the
  ragged groups of ``ragged_launch_plan.h``), the plan the Metal launcher
  uses, and in AddressSanitizer builds poisons memory (K/V
  positions no query row attends); it also exposes the run-time library
  names and sources (``csrc/metal/kernel_library.h``) and the metallib/source
  choice (``csrc/metal/backend_choice.h``); ``build.py`` compiles and caches
  the library, plain, sanitized, or counting every load of the kernel per
  buffer (``load_counter.cpp``); ``driver.py`` calls it through ctypes;
- ``sources.py`` makes sources of fewer kernels (the source's ``MBD_KERNELS``
  switch, as eval_gpu's run-time libraries) or with one injected bug
  (``mutants.py``); ``cases.py``, ``ragged_cases.py`` (one buffer per
  request), ``check_cases.py`` and ``reference.py`` (float64) make and check
  the tests' inputs; ``ragged_buffers.py`` gives a ragged call's requests the
  device buffers eval_gpu would bind, one per numpy buffer their views share.

- ``strict/`` compiles the same text with clang against an MSL shim whose
  address spaces are distinct (and lints it for what MSL forbids), the check
  the emulation's erased address spaces cannot make.

What it cannot show: that Apple's compiler accepts the source (the strict
compile narrows that, it does not close it), GPU speed, and races between
threadgroups (they run one after another).
"""
