"""The CPU kernel on dense rows of every dtype under AddressSanitizer + UBSan.

tests/kernels/cpu/asan/dtype_kernel_driver.cpp runs the kernel (its baseline build) on 90 random
calls with float16, bfloat16 and float32 rows of head dims with kernels of their own and generic
ones, values of another head dim now and then, GQA groups of 1 to 8, uneven lengths, starts,
windows, sinks and a softcap, in exact-size allocations, with NaN keys and values past every
length; each output is compared with a float64 reference.
"""

from tests.support.cpu_asan import assert_clean, build_driver, require_toolchain, run_driver
from tests.support.repo import REPO


def test_dtype_kernel_is_clean():
    require_toolchain()
    assert_clean(build_driver("dtype_kernel_driver"))


def test_dropped_sink_is_caught():
    require_toolchain()
    guard = "float l = sink == kNegInf ? 0.0f : std::exp(sink - m_all);"
    source = (REPO / "csrc" / "cpu" / "decode_kernel.cpp").read_text()
    assert source.count(guard) == 1
    code, output = run_driver(build_driver("dtype_kernel_driver",
                                           {"cpu/decode_kernel.cpp": source.replace(guard, "float l = 0.0f;")}))
    assert code != 0 and "mismatches" in output, output[-3000:]
