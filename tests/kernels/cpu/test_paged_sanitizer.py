"""The CPU kernel's paged row source and shared-block scheduler under AddressSanitizer + UBSan.

tests/kernels/cpu/asan/paged_kernel_driver.cpp runs the kernel (its baseline build) on 300 random
adversarial block tables and lengths (wild entries inside the length, garbage past it,
lengths below 0 and past the tables, copied tables whose blocks are shared), with every
buffer an exact-size heap allocation, so a read outside a pool or a table is reported, and
compares each output with a float64 reference. Objects are cached in build/paged-asan;
tests/kernels/cpu/test_sanitizers.py also runs the paged op's Python tests on the sanitized extension.
"""

import pathlib
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from tests.support.repo import REPO

BUILD = REPO / "build" / "paged-asan"
SOURCES = [REPO / "tests" / "kernels" / "cpu" / "asan" / "paged_kernel_driver.cpp"] + [
    REPO / "csrc" / "cpu" / f"{name}.cpp" for name in ("decode_kernel", "parallel_decode", "shared_blocks",
                                                         "worker_pool", "isa")]
FLAGS = ["-std=c++20", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         "-fno-omit-frame-pointer", "-fopenmp-simd", "-Wno-psabi", "-DMBD_CPU_ISA=baseline",
         f"-I{REPO / 'csrc'}", f"-isystem{pathlib.Path(mx.__file__).parent / 'include'}"]


def compile_object(source):
    obj = BUILD / (source.stem + ".o")
    headers = max(p.stat().st_mtime for p in (REPO / "csrc").rglob("*.h"))
    if not obj.exists() or obj.stat().st_mtime < max(source.stat().st_mtime, headers):
        done = subprocess.run(["g++", *FLAGS, "-c", str(source), "-o", str(obj)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]
    return obj


def test_paged_kernel_on_adversarial_tables_is_clean():
    if sys.platform != "linux" or shutil.which("g++") is None:
        pytest.skip("the sanitizer driver is set up for Linux and g++")
    BUILD.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(2) as pool:  # at most 2 compiler jobs on the shared machine
        objects = list(pool.map(compile_object, SOURCES))
    driver = BUILD / "driver"
    done = subprocess.run(["g++", "-fsanitize=address,undefined", *map(str, objects), "-o", str(driver),
                           "-lpthread"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    env = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1", "UBSAN_OPTIONS": "print_stacktrace=1"}
    run = subprocess.run([str(driver)], capture_output=True, text=True, env=env, timeout=600)
    output = run.stdout + run.stderr
    assert "ERROR: AddressSanitizer" not in output and "runtime error:" not in output, output[-6000:]
    assert run.returncode == 0 and output.startswith("OK: 0 mismatches"), output[-6000:]
    # The shared path ran: copied tables put shared blocks in most rounds.
    assert int(output.split(",")[1].split()[0]) > 0, output


def test_dropped_pool_bound_is_reported():
    # A copy of the kernel whose row source dereferences table entries past the pool must be
    # reported: the driver's tables hold such entries inside the lengths.
    if sys.platform != "linux" or shutil.which("g++") is None:
        pytest.skip("the sanitizer driver is set up for Linux and g++")
    guard = "const bool valid = entry >= 0 && entry < num_blocks;"
    source = (REPO / "csrc" / "cpu" / "row_source.h").read_text()
    assert source.count(guard) == 1
    mutant = BUILD / "mutant"
    (mutant / "cpu").mkdir(parents=True, exist_ok=True)
    # Searched before csrc/, so the kernel includes this copy.
    (mutant / "cpu" / "row_source.h").write_text(source.replace(guard, "const bool valid = entry >= 0;"))
    kernel = mutant / "decode_kernel.o"
    done = subprocess.run(["g++", f"-I{mutant}", *FLAGS, "-c", str(SOURCES[1]), "-o", str(kernel)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    objects = [compile_object(s) for s in SOURCES if s.stem != "decode_kernel"]
    driver = mutant / "driver"
    done = subprocess.run(["g++", "-fsanitize=address,undefined", str(kernel), *map(str, objects), "-o",
                           str(driver), "-lpthread"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    run = subprocess.run([str(driver)], capture_output=True, text=True, env={"ASAN_OPTIONS": "detect_leaks=0"},
                         timeout=600)
    assert run.returncode != 0 and "ERROR: AddressSanitizer" in run.stderr, (run.stdout + run.stderr)[-3000:]
