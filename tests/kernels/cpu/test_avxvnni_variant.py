"""The AVX-VNNI variant: the AVX2 variant's quantized kernels with AVX-VNNI's vpdpwssd.

It serves Intel cores without AVX-512 from Alder Lake on, scoring quantized keys with one
instruction per 16 words where AVX2 takes two (vpmaddwd, vpaddd). Its source is the AVX2
variant's but for that instruction (``wdot`` in csrc/cpu/quantized_tiles.h), and the AVX2 variant
runs every quantized test here; the variant itself is untested on hardware (the development and CI
machines lack AVX-VNNI, and QEMU's x86 emulation does not implement it), so these tests check
that it is built with its instruction and offered only where the CPU has it.
"""

import shutil
import subprocess
import sys

import pytest

from mlx_batched_decode import _ext
from tests.support.cpu_isa import cpu_flags


@pytest.fixture(autouse=True)
def built_variant():
    if "avxvnni" not in _ext.built_cpu_isas():
        pytest.skip("this build has no AVX-VNNI variant (not x86-64, a compiler without -mavxvnni, or "
                    "MBD_CPU_VARIANTS without it)")


def test_variant_holds_the_vex_dot_product():
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("needs objdump (binutils)")
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", _ext.__file__], capture_output=True, text=True,
                          check=True).stdout
    assert "{vex} vpdpwssd" in text


def test_variant_offered_only_where_the_cpu_has_it():
    if sys.platform != "linux":
        pytest.skip("reads /proc/cpuinfo")
    flags = cpu_flags()
    runs = {"avx2", "fma", "f16c", "avx_vnni"} <= flags
    assert ("avxvnni" in _ext.cpu_isas()) == runs
    if not runs:
        with pytest.raises(ValueError, match="not available"):
            _ext.set_cpu_isa("avxvnni")
