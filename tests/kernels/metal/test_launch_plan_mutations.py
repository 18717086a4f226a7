"""What guards the thread limits is proven by mutants: copies of the launch plan
(csrc/metal/launch_plan.h) that ignore a pipeline's maxTotalThreadsPerThreadgroup,
skip the check of a limit below one simdgroup, size the reduce by the main
pipeline's limit, or keep every row chunk in one threadgroup whatever the limit,
must each make the plan's unit tests (test_launch_plan.py) fail.

Each mutant builds the harness library (its launcher, which compiles the plan, and
the harness's self-test kernel: the plan tests run no kernel) and runs those
tests in a subprocess, as a mutant may also crash (a division by a limit of 0
simdgroups).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.kernels.metal.test_launch_plan import PLAN_LIBRARY
from tests.metal_emu.build import HARNESS, build_library
from tests.metal_emu.mutants import PLAN_MUTATIONS, plan_mutant_host
from tests.support.repo import REPO

SELFTEST = HARNESS / "selftest.metal"


def plan_tests_pass(library) -> bool:
    env = {**os.environ, PLAN_LIBRARY: str(library)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                             str(REPO / "tests" / "kernels" / "metal" / "test_launch_plan.py")],
                            cwd=REPO, env=env, capture_output=True, text=True)
    return result.returncode == 0


def test_unmutated_plan_passes():
    assert plan_tests_pass(build_library(SELFTEST))


@pytest.mark.parametrize("name", sorted(PLAN_MUTATIONS))
def test_plan_mutant_fails_the_plan_tests(name):
    assert not plan_tests_pass(build_library(SELFTEST, host=plan_mutant_host(name))), name
