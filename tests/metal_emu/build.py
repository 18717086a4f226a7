"""Builds the emulated kernel library: flatten, pre-pass, then g++ (C++20), cached.

Kernel sources are first flattened by cmake/metal_source.py, the generator of
the source embedded in ``_ext``: for the kernel directory, every ``.metal``
file in it in name order, as CMake passes them, so the harness compiles the
text ``mlx_batched_decode.metal_source()`` returns (it is kept next to the
library as ``source.metal``). The cache key is the hash of everything that goes into
the library (pre-passed kernel, harness sources, flags, compiler), so an edit
rebuilds and a rerun of the suite does not. The runtime and launcher objects
are cached per flags and linked into every kernel's library, so a mutant only
compiles its kernel.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..support.repo import REPO
from .prepass import prepass

HARNESS = Path(__file__).resolve().parent
KERNEL_DIR = REPO / "csrc" / "kernels"
CACHE = Path(os.environ.get("MLX_BATCHED_DECODE_EMU_CACHE", Path(tempfile.gettempdir()) / "mlx_batched_decode_emu"))

_spec = importlib.util.spec_from_file_location("metal_source", REPO / "cmake" / "metal_source.py")
metal_source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(metal_source)

CXX = os.environ.get("CXX", "g++")
# Kernel warnings fail the build; MSL attributes ([[buffer(i)]], ...) are unknown to g++.
BASE_FLAGS = ["-std=c++20", "-fPIC", "-Wall", "-Wextra", "-Werror", "-Wno-attributes"]
HOST = REPO / "csrc"


def _includes(host: Path, harness: Path = HARNESS) -> list[str]:
    return [f"-I{harness}", f"-I{harness / 'include'}", f"-I{host}"]


@dataclass(frozen=True)
class Variant:
    """One kind of build: flags of every object and the link, flags of the kernel object only, extra harness sources."""

    flags: tuple[str, ...]
    kernel_flags: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()


VARIANTS = {
    None: Variant(("-O2",)),
    "address": Variant(("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                        "-fno-sanitize-recover=all")),
    "thread": Variant(("-O1", "-g", "-fsanitize=thread")),
    # Every load the kernel's source makes (-O0: none optimised away) calls a
    # hook in load_counter.cpp, which counts the bytes per bound buffer.
    "loads": Variant(("-O0",), ("-fsanitize=kernel-address", "--param=asan-stack=0", "--param=asan-globals=0",
                                "--param=asan-instrumentation-with-call-threshold=0"), ("load_counter.cpp",)),
}


class BuildError(Exception):
    """g++ or the pre-pass rejected the kernel; the message holds the diagnostics."""


def kernel_text(source: Path = KERNEL_DIR) -> str:
    """The flattened Metal source of a ``.metal`` file, or of a directory's (CMake's
    glob of ``*.metal``, in name order): for KERNEL_DIR, the text ``_ext`` embeds."""
    source = Path(source)
    return metal_source.flatten(sorted(source.glob("*.metal")) if source.is_dir() else [source])


# The host headers the harness compiles (the launch plan and what it includes), relative to HOST.
HOST_HEADERS = ["metal/launch_plan.h", "metal/kernel_library.h", "metal/quantized_launch_plan.h",
                "kernels/quantized_batched_decode_attention_params.h", "metal/ragged_launch_plan.h",
                "kernels/ragged_decode_attention_params.h", "metal/backend_choice.h", "head_dims.h",
                "kernels/batched_decode_attention_params.h"]


def _harness_files(host: Path, harness: Path = HARNESS) -> list[Path]:
    return sorted([*harness.glob("*.h"), *harness.glob("*.cpp"), *(harness / "include").iterdir(),
                   *(host / name for name in HOST_HEADERS)])


def _compile(flags: list[str], source: Path, obj: Path, host: Path, harness: Path = HARNESS) -> None:
    """Compiles ``source`` to ``obj``, atomically: a concurrent build sees all or nothing."""
    partial = obj.with_name(f".{obj.name}.{os.getpid()}")
    cmd = ["nice", CXX, *flags, *_includes(host, harness), "-c", str(source), "-o", str(partial)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"{' '.join(cmd)}\n{result.stderr}")
    os.replace(partial, obj)


def mutant_harness(directory: Path, header: str, original: str, replacement: str) -> Path:
    """A copy of the harness headers in ``directory`` (replaced if there) with ``original``
    replaced by ``replacement`` exactly once in ``header``: a mutant of the harness's model."""
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(HARNESS, directory, ignore=shutil.ignore_patterns("*.py", "__pycache__", "strict"))
    text = (directory / header).read_text()
    assert text.count(original) == 1, f"{original!r} no longer matches {header} exactly once"
    (directory / header).write_text(text.replace(original, replacement))
    return directory


def build_library(source: Path | str = KERNEL_DIR, sanitize: str | None = None, host: Path = HOST,
                  harness: Path = HARNESS) -> Path:
    """Path of the shared library running ``source`` on the CPU: a .metal file or
    a directory of them (flattened first, see ``kernel_text``), or an already
    flattened Metal text.

    ``sanitize``: None, "address" (AddressSanitizer + UBSan), "thread"
    (ThreadSanitizer) or "loads" (counts the bytes the kernels load, see
    ``EmulatedLibrary.loads``). ``host``: the directory of the host headers
    (HOST_HEADERS: the launch plan), csrc/ or a copy with a mutant of the plan.
    ``harness``: the directory of the headers the kernel is compiled with, this
    one or a ``mutant_harness`` (the runtime objects always come from this one).
    """
    text = kernel_text(source) if isinstance(source, Path) else source
    translated = prepass(text)
    variant = VARIANTS[sanitize]
    flags = BASE_FLAGS + list(variant.flags)
    version = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
    hashes = []
    for directory in (HARNESS, harness):
        digest = hashlib.sha256()
        for part in [" ".join([*flags, *variant.kernel_flags, *variant.sources]), version] + [
                f.read_text() for f in _harness_files(host, directory)]:
            digest.update(part.encode())
        hashes.append(digest.hexdigest())
    target = CACHE / hashlib.sha256("".join([*hashes, translated]).encode()).hexdigest()[:24] / "libmetal_emu.so"
    if target.exists():
        return target

    # The runtime and launcher objects depend on the flags only: every kernel shares them.
    shared = CACHE / "harness" / hashes[0][:24]
    shared.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        kernel_cpp = work / "kernel.cpp"
        kernel_cpp.write_text(translated)
        objects = [(kernel_cpp, work / "kernel.o")] + [
            (HARNESS / name, shared / f"{Path(name).stem}.o")
            for name in ("runtime.cpp", "launcher.cpp", *variant.sources)]
        jobs = [([*flags, *variant.kernel_flags], *objects[0], host, harness)] + [
            (flags, *job, host) for job in objects[1:]]
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda job: _compile(*job), [job for job in jobs if not job[2].exists()]))
        library = work / target.name
        link = ["nice", CXX, "-shared", *flags, *(str(obj) for _, obj in objects), "-o", str(library)]
        result = subprocess.run(link, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"{' '.join(link)}\n{result.stderr}")
        (work / "source.metal").write_text(text)
        os.replace(work / "source.metal", target.parent / "source.metal")
        os.replace(library, target)  # atomic, and last: a concurrent build sees all or nothing
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target
