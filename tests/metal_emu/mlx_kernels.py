"""MLX's own Metal kernels (from the installed wheel's headers) as harness sources.

``flatten_mlx`` inlines a Metal text's ``"mlx/..."`` includes from the wheel's
include directory, once each, with ``#line`` directives naming the original
files, as cmake/metal_source.py does for this project's kernels. Three generic
MLX headers are replaced by the small stand-ins in ``mlx_shim/`` (each says
why); the kernel headers themselves (steel attention, its MMA tiles and
loaders) compile unmodified.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core

HARNESS = Path(__file__).resolve().parent
MLX_INCLUDE = Path(mlx.core.__file__).resolve().parent / "include"
KERNELS = "mlx/backend/metal/kernels"
SHIMS = {
    f"{KERNELS}/utils.h": HARNESS / "mlx_shim" / "utils.h",
    f"{KERNELS}/steel/utils/type_traits.h": HARNESS / "mlx_shim" / "type_traits.h",
    f"{KERNELS}/steel/defines.h": HARNESS / "mlx_shim" / "defines.h",
}
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
_DROPPED = re.compile(r"^\s*#\s*pragma\s+(once|METAL)\b")


def _inline(name: str, text: str, seen: set[str]) -> list[str]:
    out = [f'#line 1 "{name}"']
    for number, line in enumerate(text.splitlines(), start=1):
        match = _INCLUDE.match(line)
        if _DROPPED.match(line):
            out.append("")
        elif match is None:
            out.append(line)
        else:
            include = match.group(1)
            if include not in seen:
                seen.add(include)
                path = SHIMS.get(include, MLX_INCLUDE / include)
                if not path.is_file():
                    raise FileNotFoundError(f"{name}:{number}: cannot find {include} in {MLX_INCLUDE}")
                out.extend(_inline(path.name, path.read_text(), seen))
            out.append(f'#line {number + 1} "{name}"')
    return out


def flatten_mlx(name: str, text: str) -> str:
    """The Metal ``text`` (called ``name`` in diagnostics) with its MLX includes inlined."""
    return "\n".join(_inline(name, text, set())) + "\n"
