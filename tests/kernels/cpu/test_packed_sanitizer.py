"""The CPU kernel on packed queries (query_starts) under AddressSanitizer + UBSan.

tests/kernels/cpu/asan/packed_kernel_driver.cpp runs the kernel (its baseline build) on 300 random
calls with packed queries of 0 to 37 rows per request, keys and values of head dims of their own,
adversarial lengths and starts, a softcap in every other call, and query_starts that are malformed
in every third call, all in exact-size allocations, so that any access outside them is reported;
each output is compared with a float64 reference, and malformed starts must give zeros. Mutants of
the kernel (starts unchecked, rows one position late, softcap dropped, values read as wide as the
keys) must each be caught.
"""

import pytest

from tests.support.cpu_asan import assert_clean, build_driver, require_toolchain, run_driver
from tests.support.repo import REPO


def mutant(path, old, new):
    source = (REPO / "csrc" / path).read_text()
    assert source.count(old) == 1, old
    return {path: source.replace(old, new)}


def test_packed_kernel_on_adversarial_starts_is_clean():
    require_toolchain()
    assert_clean(build_driver("packed_kernel_driver"))


# (what breaks, file, text, its replacement, what the driver's output must say)
MUTANTS = [
    # Without the kernel's own check, malformed starts give rows of two requests, or of none.
    ("starts unchecked", "cpu/parallel_decode.cpp", "if (args.query_starts && !args.packed_rows_valid()) {",
     "if (false) {", "malformed starts"),
    # Rows one position late attend a key past their request's length.
    ("position off by one", "cpu/decode_args.h", "    const int p = len - L + i;\n",
     "    const int p = len - L + i + 1;\n", "mismatches"),
    ("softcap dropped", "cpu/decode_kernel.cpp", "sp < n_spans && a.softcap > 0.0f;", "sp < n_spans && false;",
     "mismatches"),
    # Values read as wide as the keys: past the values' allocation, or wrong outputs.
    ("values' head dim from the keys", "cpu/decode_args.h", "    v.D = Dv;\n    v.Dp = Dvp;\n", "", ""),
]


@pytest.mark.parametrize("what, path, old, new, says", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_mutant_is_caught(what, path, old, new, says):
    require_toolchain()
    code, output = run_driver(build_driver("packed_kernel_driver", mutant(path, old, new)))
    assert code != 0 and says in output, output[-3000:]
