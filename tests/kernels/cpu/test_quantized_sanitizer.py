"""The CPU kernel on quantized keys and values under AddressSanitizer + UBSan.

tests/kernels/cpu/asan/quantized_kernel_driver.cpp runs the kernel (its baseline build) on 96
random calls with keys and values in mx.quantize's affine format (4 and 8 bits, groups of 32 to
128, float32 or float16 scales and biases, values of one group now and then), queries of every
dtype, GQA groups of 1 to 16, uneven lengths, starts, windows and a softcap, in exact-size
allocations, with NaN scales and biases past every length; each output is compared with a
float64 reference on the dequantized rows.
"""

from tests.support.cpu_asan import assert_clean, build_driver, require_toolchain, run_driver
from tests.support.repo import REPO


def test_quantized_kernel_is_clean():
    require_toolchain()
    assert_clean(build_driver("quantized_kernel_driver"))


def test_values_read_as_wide_as_the_keys_are_reported():
    # The value side's rows and groups taken from the keys' head dim read past the values'
    # allocations when they are narrower.
    require_toolchain()
    guard = "const int dim = side ? a.Dv : a.D;"
    source = (REPO / "csrc" / "cpu" / "decode_kernel.cpp").read_text()
    assert source.count(guard) == 1
    code, output = run_driver(build_driver("quantized_kernel_driver",
                                           {"cpu/decode_kernel.cpp": source.replace(guard, "const int dim = a.D;")}))
    assert code != 0 and "ERROR: AddressSanitizer" in output, output[-3000:]
