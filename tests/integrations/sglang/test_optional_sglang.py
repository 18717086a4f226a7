"""SGLang is optional: importing the package and its plug-in entry must not import it."""

import subprocess
import sys


def test_plugin_import_does_not_import_sglang():
    code = "import sys, mlx_batched_decode.sglang; print('sglang' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
