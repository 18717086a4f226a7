"""The address-space-strict compile of the Metal source, and its MSL lint.

Where the emulation (the package above) runs the kernel with address spaces
erased, this type-checks the same flattened text as Apple's compiler would on
the points g++ cannot: ``msl_strict.h`` makes ``device``, ``constant`` and
``threadgroup`` distinct clang address spaces and declares MSL's types and
metal_stdlib overloads; ``prepass.py`` removes MSL's attributes; ``compile.py``
runs clang -fsyntax-only on every instantiation, tolerating only MSL's
implicit struct copies across address spaces (``diagnostics.py``);
``lint.py`` rejects the C++ MSL lacks (double, recursion through
``functions.py``'s call graph, function pointers, virtual, exceptions,
new/delete, thread_local, RTTI, writable static locals); ``mutants.py`` holds
sources each must reject.
"""
