"""The CPU kernel on quantized keys and values under AddressSanitizer + UBSan.

tests/kernels/cpu/asan/quantized_kernel_driver.cpp runs the kernel (its baseline build) on 96
random calls with keys and values in mx.quantize's affine format (4 and 8 bits, groups of 32 to
128, float32 or float16 scales and biases, values of one group now and then), queries of every
dtype, GQA groups of 1 to 16, uneven lengths, starts, windows and a softcap, in exact-size
allocations, with NaN scales and biases past every length; each output is compared with a
float64 reference on the dequantized rows. On CPUs with AVX-512 it runs again built as the AVX-512
variants are, for their paths: 16 keys' words transposed to score them across the lanes, the
scales and biases gathered.
"""

from tests.support.cpu_asan import (
    ASAN_AVX512,
    assert_clean,
    build_driver,
    require_avx512,
    require_toolchain,
    run_driver,
)
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


def test_quantized_kernel_is_clean_on_avx512():
    require_avx512()
    assert_clean(build_driver("quantized_kernel_driver", target=ASAN_AVX512), ASAN_AVX512)


def test_key_words_read_past_a_row_are_reported():
    # The transposes read 16 words of each key row at a time, the last ones masked to the row's
    # words; unmasked, rows of 8, 12 or 24 words (4-bit D 64 and 96, 8-bit D 96) are read past
    # their end.
    require_avx512()
    guard = "r[i] = _mm512_maskz_loadu_epi32(live, rows[i] + c);"
    source = (REPO / "csrc" / "cpu" / "quantized_tiles.h").read_text()
    assert source.count(guard) == 1
    mutant = {"cpu/quantized_tiles.h": source.replace(guard, "r[i] = _mm512_loadu_si512(rows[i] + c);")}
    code, output = run_driver(build_driver("quantized_kernel_driver", mutant, ASAN_AVX512), ASAN_AVX512)
    assert code != 0 and "ERROR: AddressSanitizer" in output, output[-3000:]
