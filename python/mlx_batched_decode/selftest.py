"""``python -m mlx_batched_decode.selftest [--quick]``: run this first on a new machine.

Checks every op against the reference on the default device and times it; the work is in
``tools/selftest`` (see its ``main``).
"""

import sys

from .tools.selftest.main import main

if __name__ == "__main__":
    sys.exit(main())
