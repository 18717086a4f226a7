"""The CPU kernel on packed queries (query_starts) under AddressSanitizer + UBSan.

tests/kernels/cpu/asan/packed_kernel_driver.cpp runs the kernel (its baseline build) on 300 random
calls with packed queries of 0 to 37 rows per request, keys and values of head dims of their own,
adversarial lengths and starts, a softcap in every other call, and query_starts that are malformed
in every sixth call, all in exact-size allocations, so that any access outside them is reported;
each output is compared with a float64 reference, and malformed starts must give zeros. Mutants of
the kernel (starts unchecked, rows one position late, softcap dropped, values read as wide as the
keys) must each be caught.
"""

from tests.support.cpu_asan import REPO, assert_clean, build_driver, require_toolchain, run_driver


def mutant(path, old, new):
    source = (REPO / "csrc" / path).read_text()
    assert source.count(old) == 1, old
    return {path: source.replace(old, new)}


def test_packed_kernel_on_adversarial_starts_is_clean():
    require_toolchain()
    assert_clean(build_driver("packed_kernel_driver"))


def test_unchecked_starts_are_caught():
    # Without the kernel's own check of query_starts, malformed ones give rows of two requests (or none).
    require_toolchain()
    m = mutant("cpu/parallel_decode.cpp", "if (args.query_starts && !args.packed_rows_valid()) {", "if (false) {")
    code, output = run_driver(build_driver("packed_kernel_driver", m))
    assert code != 0 and "malformed starts" in output, output[-3000:]


def test_position_off_by_one_is_caught():
    # Rows one position late attend a key past their request's length.
    require_toolchain()
    m = mutant("cpu/decode_args.h", "    const int p = len - L + i;\n", "    const int p = len - L + i + 1;\n")
    code, output = run_driver(build_driver("packed_kernel_driver", m))
    assert code != 0 and ("mismatches" in output or "AddressSanitizer" in output), output[-3000:]


def test_dropped_softcap_is_caught():
    require_toolchain()
    m = mutant("cpu/decode_kernel.cpp", "sp < n_spans && a.softcap > 0.0f;", "sp < n_spans && false;")
    code, output = run_driver(build_driver("packed_kernel_driver", m))
    assert code != 0 and "mismatches" in output, output[-3000:]


def test_values_head_dim_taken_from_the_keys_is_caught():
    # Values read D wide where they are Dv wide: reads past the values' allocation, wrong outputs.
    require_toolchain()
    m = mutant("cpu/decode_args.h", "    v.D = Dv;\n    v.Dp = Dvp;\n", "")
    code, output = run_driver(build_driver("packed_kernel_driver", m))
    assert code != 0, output[-3000:]
