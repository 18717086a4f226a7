"""Builds and runs a driver of the CPU kernel (its baseline build) under AddressSanitizer + UBSan.

A driver in tests/kernels/cpu/asan/ calls ``run_decode`` on exact-size heap buffers, so a read
outside one is reported. Objects are cached in build/cpu-asan; a mutant build compiles the kernel
with copies of some of its files, the headers among them found before csrc/'s.
"""

import pathlib
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from tests.support.repo import REPO

BUILD = REPO / "build" / "cpu-asan"
DRIVERS = REPO / "tests" / "kernels" / "cpu" / "asan"
KERNEL = [REPO / "csrc" / "cpu" / f"{name}.cpp" for name in ("decode_kernel", "parallel_decode", "shared_blocks",
                                                              "worker_pool", "isa")]
FLAGS = ["-std=c++20", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         "-fno-omit-frame-pointer", "-fopenmp-simd", "-Wno-psabi", "-DMBD_CPU_ISA=baseline",
         f"-I{REPO / 'csrc'}", f"-isystem{pathlib.Path(mx.__file__).parent / 'include'}"]


def require_toolchain():
    if sys.platform != "linux" or shutil.which("g++") is None:
        pytest.skip("the sanitizer drivers are set up for Linux and g++")


def compile_object(source, out_dir=BUILD, includes=()):
    """source compiled into out_dir, unless an object newer than it and every header is there."""
    obj = out_dir / (source.stem + ".o")
    headers = max(p.stat().st_mtime for p in [*(REPO / "csrc").rglob("*.h"), *DRIVERS.glob("*.h")])
    if not obj.exists() or obj.stat().st_mtime < max(source.stat().st_mtime, headers):
        flags = [f"-I{d}" for d in includes] + FLAGS
        done = subprocess.run(["g++", *flags, "-c", str(source), "-o", str(obj)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]
    return obj


def build_driver(name, mutant=None):
    """The driver tests/kernels/cpu/asan/<name>.cpp linked with the kernel; mutant maps a
    kernel file's path under csrc/ (a header or a source) to the text its copy holds, and then
    the kernel sources it may change are rebuilt with the copies."""
    BUILD.mkdir(parents=True, exist_ok=True)
    sources = [DRIVERS / f"{name}.cpp", *KERNEL]
    with ThreadPoolExecutor(2) as pool:  # at most 2 compiler jobs on the shared machine
        objects = list(pool.map(compile_object, sources))
    out = BUILD / name
    if mutant:
        copies = BUILD / f"{name}-mutant"
        for path, text in mutant.items():
            (copies / path).parent.mkdir(parents=True, exist_ok=True)
            (copies / path).write_text(text)
        (copies / "obj").mkdir(exist_ok=True)
        # Rebuilt every time: the cache cannot tell one mutant from another.
        for stale in (copies / "obj").glob("*.o"):
            stale.unlink()
        headers = any(path.endswith(".h") for path in mutant)
        for i, source in enumerate(KERNEL, start=1):
            path = str(source.relative_to(REPO / "csrc"))
            # A changed header may change every source; a changed source only itself.
            if headers or path in mutant:
                copy = copies / path if path in mutant else source
                objects[i] = compile_object(copy, copies / "obj", includes=[copies])
        out = copies / "driver"
    done = subprocess.run(["g++", "-fsanitize=address,undefined", *map(str, objects), "-o", str(out), "-lpthread"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def run_driver(driver):
    """(return code, stdout + stderr) of a driver run."""
    env = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1", "UBSAN_OPTIONS": "print_stacktrace=1"}
    run = subprocess.run([str(driver)], capture_output=True, text=True, env=env, timeout=600)
    return run.returncode, run.stdout + run.stderr


def assert_clean(driver):
    """Runs a driver and returns its output, which must hold no report and start with "OK"."""
    code, output = run_driver(driver)
    assert "ERROR: AddressSanitizer" not in output and "runtime error:" not in output, output[-6000:]
    assert code == 0 and output.startswith("OK: 0 mismatches"), output[-6000:]
    return output
