"""mlx-lm is an optional extra: importing the package must not import it."""

import subprocess
import sys


def test_package_import_does_not_import_mlx_lm():
    code = "import sys, mlx_batched_decode; print('mlx_lm' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
