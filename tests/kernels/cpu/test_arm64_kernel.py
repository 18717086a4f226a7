"""The CPU kernel's arm64 build, run under emulation.

On arm64 the kernel's baseline variant is the kernel of every CPU (Macs among them, on MLX's CPU
stream). It is cross-compiled here with Debian's aarch64 GCC twice: for ARMv8.0, which scores
quantized keys with the float loops, and for ARMv8.2 with the dot product (what Apple's compilers
target for arm64 Macs), which scores them with sdot on the query words' bytes. Every native
driver in tests/kernels/cpu/asan/ (every dtype and head dim, packed queries, paged, ragged and
ring rows, quantized keys and values) runs under qemu-aarch64 against its float64 reference.
Mutants of the sdot path must be caught, so the path is proven to run. Emulation proves results,
not speed.
"""

import shutil
import subprocess
import sys

import pytest

from tests.support import native_drivers
from tests.support.repo import REPO

# The compiler package brings aarch64-linux-gnu-objdump and the sysroot the emulator loads from.
COMPILER, EMULATOR, SYSROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", "/usr/aarch64-linux-gnu"


def target(name, march, level="-O2"):
    return native_drivers.Target(name, COMPILER, (level, f"-march={march}"),
                                 runner=(shutil.which(EMULATOR) or EMULATOR, "-L", SYSROOT))


ARMV8 = target("cpu-arm64-v8", "armv8-a")
DOTPROD = target("cpu-arm64-dotprod", "armv8.2-a+dotprod")
# Mutants rebuild the kernel each: at -O1, in two thirds of the time.
DOTPROD_MUTANTS = target("cpu-arm64-dotprod-mutants", "armv8.2-a+dotprod", "-O1")
DRIVERS = ["dtype_kernel_driver", "packed_kernel_driver", "paged_kernel_driver", "ragged_kernel_driver",
           "ring_kernel_driver", "quantized_kernel_driver"]


@pytest.fixture(scope="module", autouse=True)
def require_cross_toolchain():
    if sys.platform != "linux" or shutil.which(COMPILER) is None or shutil.which(EMULATOR) is None:
        pytest.skip(f"needs {COMPILER} and {EMULATOR} (Debian: g++-aarch64-linux-gnu qemu-user)")


def run(target, name, mutant=None):
    return native_drivers.run_driver(target, native_drivers.build_driver(target, name, mutant))


@pytest.mark.parametrize("name", DRIVERS)
@pytest.mark.parametrize("target", [ARMV8, DOTPROD], ids=["armv8", "dotprod"])
def test_driver_matches_its_reference(target, name):
    code, output = run(target, name)
    assert code == 0 and output.startswith("OK: 0 mismatches"), output[-3000:]


def test_builds_differ_in_the_dot_product():
    """The ARMv8.2 build holds sdot instructions, the ARMv8.0 one none: the two runs above cover
    both quantized score loops."""
    counts = {}
    for t in (ARMV8, DOTPROD):
        native_drivers.build_driver(t, "quantized_kernel_driver")
        text = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(t.build / "decode_kernel.o")],
                              capture_output=True, text=True, check=True).stdout
        counts[t.name] = sum("\tsdot\t" in line for line in text.splitlines())
    assert counts[ARMV8.name] == 0 and counts[DOTPROD.name] > 0, counts


# (what breaks, text in csrc/cpu/quantized_tiles.h, its replacement)
MUTANTS = [
    ("high bytes not weighted by 256", "vshlq_n_s32(v.hi, 8)", "vshlq_n_s32(v.hi, 7)"),
    ("8-bit keys' centre not added back", "bias += kKeyCentre<Bits> * kg[j];", ""),
    ("high bytes floored, low ones past a signed byte", "const int hi = (chunk[e] + 128) >> 8;",
     "const int hi = chunk[e] >> 8;"),
    ("4-bit keys' nibbles in the wrong order", "vcombine_u8(vand_u8(x, vdup_n_u8(15)), vshr_n_u8(x, 4))",
     "vcombine_u8(vshr_n_u8(x, 4), vand_u8(x, vdup_n_u8(15)))"),
]


@pytest.mark.parametrize("what, old, new", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_dot_product_mutant_is_caught(what, old, new):
    source = (REPO / "csrc" / "cpu" / "quantized_tiles.h").read_text()
    assert source.count(old) == 1, old
    code, output = run(DOTPROD_MUTANTS, "quantized_kernel_driver", {"cpu/quantized_tiles.h": source.replace(old, new)})
    assert code != 0 and "mismatches" in output, output[-3000:]
