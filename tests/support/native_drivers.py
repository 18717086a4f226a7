"""Builds and runs the CPU kernel's native drivers (tests/kernels/cpu/asan/) for a target.

A driver calls ``run_decode`` on exact-size heap buffers and checks the outputs against a float64
reference. A ``Target`` names the compiler and flags its objects are built with, where they are
cached (build/<name>), and the command a driver runs under (an emulator for another
architecture). A mutant build compiles the kernel with copies of some of its files, the headers
among them found before csrc/'s.
"""

import dataclasses
import pathlib
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx

from tests.support.repo import REPO

DRIVERS = REPO / "tests" / "kernels" / "cpu" / "asan"
KERNEL = [REPO / "csrc" / "cpu" / f"{name}.cpp" for name in ("decode_kernel", "parallel_decode", "shared_blocks",
                                                              "worker_pool", "isa")]
# Every target builds the kernel's baseline variant: the one that serves any CPU of its architecture.
COMMON_FLAGS = ("-std=c++20", "-fopenmp-simd", "-Wno-psabi", "-DMBD_CPU_ISA=baseline", f"-I{REPO / 'csrc'}",
                f"-isystem{pathlib.Path(mx.__file__).parent / 'include'}")


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # build/<name> caches its objects
    compiler: str
    flags: tuple  # compile flags besides COMMON_FLAGS
    link_flags: tuple = ()
    runner: tuple = ()  # the command a driver runs under, before its path
    env: tuple = ()  # (name, value) pairs of the driver's environment

    @property
    def build(self):
        return REPO / "build" / self.name


def compile_object(target, source, out_dir=None, includes=()):
    """source compiled into out_dir (the target's build folder), unless an object newer than it and
    every header is there."""
    out_dir = out_dir or target.build
    obj = out_dir / (source.stem + ".o")
    headers = max(p.stat().st_mtime for p in [*(REPO / "csrc").rglob("*.h"), *DRIVERS.glob("*.h")])
    if not obj.exists() or obj.stat().st_mtime < max(source.stat().st_mtime, headers):
        flags = [f"-I{d}" for d in includes] + list(target.flags) + list(COMMON_FLAGS)
        done = subprocess.run([target.compiler, *flags, "-c", str(source), "-o", str(obj)], capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr[-4000:]
    return obj


def included(target, source):
    """The headers source includes, directly or not, as paths."""
    done = subprocess.run([target.compiler, *target.flags, *COMMON_FLAGS, "-MM", str(source)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    names = done.stdout.replace("\\\n", " ").split()[1:]
    return {pathlib.Path(name).resolve() for name in names if name.endswith(".h")}


def build_driver(target, name, mutant=None):
    """The driver tests/kernels/cpu/asan/<name>.cpp linked with the kernel; mutant maps a
    kernel file's path under csrc/ (a header or a source) to the text its copy holds, and then
    the kernel sources it may change are rebuilt with the copies."""
    target.build.mkdir(parents=True, exist_ok=True)
    sources = [DRIVERS / f"{name}.cpp", *KERNEL]
    with ThreadPoolExecutor(2) as pool:  # at most 2 compiler jobs on the shared machine
        objects = list(pool.map(lambda source: compile_object(target, source), sources))
    out = target.build / name
    if mutant:
        copies = target.build / f"{name}-mutant"
        # Emptied first: a header left by an earlier mutant would be found before csrc/'s.
        shutil.rmtree(copies, ignore_errors=True)
        for path, text in mutant.items():
            (copies / path).parent.mkdir(parents=True, exist_ok=True)
            (copies / path).write_text(text)
        # Rebuilt every time: the cache cannot tell one mutant from another.
        (copies / "obj").mkdir()
        headers = {(REPO / "csrc" / path).resolve() for path in mutant if path.endswith(".h")}
        for i, source in enumerate(KERNEL, start=1):
            path = str(source.relative_to(REPO / "csrc"))
            # A changed header changes the sources that include it; a changed source only itself.
            if path in mutant or headers & included(target, source):
                copy = copies / path if path in mutant else source
                objects[i] = compile_object(target, copy, copies / "obj", includes=[copies])
        out = copies / "driver"
    done = subprocess.run([target.compiler, *target.link_flags, *map(str, objects), "-o", str(out), "-lpthread"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def run_driver(target, driver):
    """(return code, stdout + stderr) of a driver run."""
    run = subprocess.run([*target.runner, str(driver)], capture_output=True, text=True, env=dict(target.env),
                         timeout=600)
    return run.returncode, run.stdout + run.stderr
