"""The CPU kernel built with AddressSanitizer + UBSan runs the kernel tests cleanly.

Builds the extension's one target with -DMBD_SANITIZE=ON at -O1 -g1, with the
kernel variants this CPU runs, into build/sanitize (cached between runs),
assembles a package from it and runs the kernel and property tests in a
subprocess with the sanitizer runtimes preloaded. Any report fails the test:
UBSan is built with -fno-sanitize-recover, ASan aborts on its first error.
"""

import os
import shutil
import site
import subprocess
import sys

import pytest

from mlx_batched_decode import _ext
from tests.support.repo import REPO

BUILD = REPO / "build" / "sanitize"
KERNEL_TESTS = [
    "tests/ops/test_batched_decode_attention.py",
    "tests/ops/test_decode_shapes.py",
    "tests/kernels/cpu/test_cpu_tiles.py",
    "tests/ops/test_properties.py",
    "tests/ops/test_strided_inputs.py",
    "tests/ops/test_transforms.py",
    "tests/ops/test_errors.py",
    "tests/ops/test_adversarial.py",
    "tests/kernels/cpu/test_concurrency.py",
    "tests/ops/test_paged_decode.py",
    "tests/ops/test_paged_adversarial.py",
    "tests/ops/test_quantized_attention.py",
    "tests/ops/test_ragged_decode.py",
    "tests/ops/test_ring_offset.py",
    "tests/ops/test_query_starts.py",
    "tests/ops/test_value_head_dim.py",
]


def runtime(name):
    path = subprocess.run(
        ["g++", f"-print-file-name={name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not os.path.isabs(path):
        pytest.fail(f"g++ has no {name}: install the compiler's sanitizer runtimes")
    return path


@pytest.fixture(scope="module")
def sanitized_package():
    if sys.platform != "linux":
        pytest.skip("the sanitizer run is set up for Linux and g++")
    for tool in ("cmake", "ninja", "g++"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is needed to build the sanitizer extension (pip install '.[test]')")
    # Only the kernel variants this CPU runs: the others' instrumented code would never execute here.
    configure = [
        "cmake", "-S", str(REPO), "-B", str(BUILD), "-G", "Ninja",
        "-DMBD_SANITIZE=ON", "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
        # ASan's advised -O1, and line tables for the reports: at -O2 -g GCC 12 spends 20 minutes
        # or more on each instrumented AVX variant of the kernel (its register allocator), 3 here.
        "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG",
        f"-DMBD_CPU_VARIANTS={';'.join(_ext.cpu_isas())}",
        f"-DPython_EXECUTABLE={sys.executable}",
    ]
    for cmd in (configure, ["cmake", "--build", str(BUILD), "--target", "_ext"]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    pkg = BUILD / "pkg" / "mlx_batched_decode"
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(REPO / "python" / "mlx_batched_decode", pkg)
    (ext,) = BUILD.glob("_ext*.so")
    shutil.copy(ext, pkg)
    return pkg


def test_extension_is_instrumented(sanitized_package):
    (ext,) = sanitized_package.glob("_ext*.so")
    symbols = subprocess.run(["nm", "-D", str(ext)], capture_output=True, text=True).stdout
    assert "__asan_report_load" in symbols
    assert "__ubsan_handle" in symbols


def test_kernel_tests_under_sanitizers(sanitized_package):
    # -S skips site hooks (such as an editable install's finder), so the
    # sanitized package placed first on the path is the one imported.
    paths = [str(sanitized_package.parent), *site.getsitepackages()]
    code = (
        "import sys; sys.path[:0] = %r\n"
        "import mlx_batched_decode as m\n"
        "assert m._ext.__file__.startswith(%r), m._ext.__file__\n"
        "assert m._ext.cpu_isas() == %r, m._ext.cpu_isas()\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *%r]))\n"
    ) % (paths, str(sanitized_package), _ext.cpu_isas(), KERNEL_TESTS)
    env = dict(
        os.environ,
        LD_PRELOAD=f"{runtime('libasan.so')} {runtime('libstdc++.so')}",
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1",
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    output = done.stdout + done.stderr
    assert "ERROR: AddressSanitizer" not in output, output[-6000:]
    assert "runtime error:" not in output, output[-6000:]
    assert done.returncode == 0, output[-6000:]
    assert " passed" in output and " failed" not in output
