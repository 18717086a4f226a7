"""Builds the emulated kernel library: pre-pass, then g++ (C++20), cached.

The cache key is the hash of everything that goes into the library (pre-passed
kernel, harness sources, flags, compiler), so an edit rebuilds and a rerun of
the suite does not. The runtime and launcher objects are cached per flags and
linked into every kernel's library, so a mutant only compiles its kernel.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .prepass import prepass

HARNESS = Path(__file__).resolve().parent
REPO = HARNESS.parents[1]
KERNEL_SOURCE = REPO / "csrc" / "kernels" / "batched_decode_attention.metal"
CACHE = Path(os.environ.get("MLX_BATCHED_DECODE_EMU_CACHE", Path(tempfile.gettempdir()) / "mlx_batched_decode_emu"))

CXX = os.environ.get("CXX", "g++")
# Kernel warnings fail the build; MSL attributes ([[buffer(i)]], ...) are unknown to g++.
BASE_FLAGS = ["-std=c++20", "-fPIC", "-Wall", "-Wextra", "-Werror", "-Wno-attributes"]
INCLUDES = [f"-I{HARNESS}", f"-I{HARNESS / 'include'}", f"-I{REPO / 'csrc'}"]
OPTIMIZED = ["-O2"]
SANITIZERS = {
    "address": ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    "thread": ["-O1", "-g", "-fsanitize=thread"],
}


class BuildError(Exception):
    """g++ or the pre-pass rejected the kernel; the message holds the diagnostics."""


def _harness_files() -> list[Path]:
    return sorted([*HARNESS.glob("*.h"), *HARNESS.glob("*.cpp"), HARNESS / "include" / "metal_stdlib",
                   REPO / "csrc" / "metal" / "launch_plan.h",
                   REPO / "csrc" / "kernels" / "batched_decode_attention_params.h"])


def _compile(flags: list[str], source: Path, obj: Path) -> None:
    """Compiles ``source`` to ``obj``, atomically: a concurrent build sees all or nothing."""
    partial = obj.with_name(f".{obj.name}.{os.getpid()}")
    cmd = ["nice", CXX, *flags, *INCLUDES, "-c", str(source), "-o", str(partial)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"{' '.join(cmd)}\n{result.stderr}")
    os.replace(partial, obj)


def build_library(kernel_source: Path = KERNEL_SOURCE, sanitize: str | None = None) -> Path:
    """Path of the shared library running ``kernel_source`` (a .metal file) on the CPU.

    ``sanitize``: None, "address" (AddressSanitizer + UBSan) or "thread" (ThreadSanitizer).
    """
    translated = prepass(Path(kernel_source), [Path(kernel_source).resolve().parent])
    flags = BASE_FLAGS + (SANITIZERS[sanitize] if sanitize else OPTIMIZED)
    version = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
    harness = hashlib.sha256()
    for part in [" ".join(flags), version] + [f.read_text() for f in _harness_files()]:
        harness.update(part.encode())
    target = CACHE / hashlib.sha256((harness.hexdigest() + translated).encode()).hexdigest()[:24] / "libmetal_emu.so"
    if target.exists():
        return target

    # The runtime and launcher objects depend on the flags only: every kernel shares them.
    shared = CACHE / "harness" / harness.hexdigest()[:24]
    shared.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        kernel_cpp = work / "kernel.cpp"
        kernel_cpp.write_text(translated)
        jobs = [(kernel_cpp, work / "kernel.o")] + [
            (HARNESS / name, shared / f"{Path(name).stem}.o") for name in ("runtime.cpp", "launcher.cpp")]
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda job: _compile(flags, *job), [job for job in jobs if not job[1].exists()]))
        library = work / target.name
        link = ["nice", CXX, "-shared", *flags, *(str(obj) for _, obj in jobs), "-o", str(library)]
        result = subprocess.run(link, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"{' '.join(link)}\n{result.stderr}")
        os.replace(library, target)  # atomic: a concurrent build sees all or nothing
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target
