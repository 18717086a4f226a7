"""Where the repository is: the one place tests and the harness locate csrc/, cmake/, build/."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
