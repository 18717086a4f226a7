"""SGLang's MLX backend, imported for the tests and the benchmark on machines where SGLang itself
does not import.

The package ``__init__`` files above the backend import torch (and SGLang's other server
dependencies), which a ``pip install --no-deps sglang`` on Linux lacks; the backend's own files
(``kv_cache/attention_wrapper.py``, ``attention_kv_cache.py``, ``model_patching.py``,
``layout.py``, ``aot.py``) import only MLX, mlx-lm and ``sglang.srt.environ``. ``load_backend()``
imports SGLang for real first (on a Mac with SGLang installed nothing is stood in); only when
that fails does it stand in the packages of ``STAND_INS`` as empty module objects whose
``__path__`` is the real folder, so their submodules load from SGLang's own files and no
``__init__`` above them runs.

The stand-in lives here, not in the plug-in: it changes what ``import sglang`` returns for the
rest of the process, which a library must not do to its user. Where SGLang does not import,
SGLang's model runner cannot run either, so the plug-in has nothing to patch there but the tests'
and the benchmark's drivers.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from mlx_batched_decode.sglang import SGLANG_VERSION

BACKEND = "sglang.srt.hardware_backend.mlx"
STAND_INS = ("sglang", "sglang.srt", "sglang.srt.hardware_backend", BACKEND, f"{BACKEND}.kv_cache")
MODULES = {
    "aot": f"{BACKEND}.aot",
    "attention_kv_cache": f"{BACKEND}.kv_cache.attention_kv_cache",
    "attention_kv_pool": f"{BACKEND}.kv_cache.attention_kv_pool",
    "attention_wrapper": f"{BACKEND}.kv_cache.attention_wrapper",
    "attention_contract": f"{BACKEND}.kv_cache.attention_contract",
    "layout": f"{BACKEND}.kv_cache.layout",
    "model_patching": f"{BACKEND}.kv_cache.model_patching",
}


def installed() -> bool:
    """Whether an ``sglang`` distribution is installed (found without importing it)."""
    return importlib.util.find_spec("sglang") is not None


def skip_reason() -> Optional[str]:
    """Why the plug-in's tests cannot run here, or ``None``: SGLang missing or another version."""
    if not installed():
        return f"sglang is not installed (pip install --no-deps sglang=={SGLANG_VERSION})"
    version = metadata.version("sglang")
    if version != SGLANG_VERSION:
        return f"the plug-in supports sglang {SGLANG_VERSION} only; {version} is installed"
    return None


def _stand_in() -> None:
    """Empty package modules over SGLang's real folders, for the packages above the backend."""
    root = Path(importlib.util.find_spec("sglang").origin).parent
    for name in STAND_INS:
        module = types.ModuleType(name)
        module.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = module
    # Submodules the failed import left loaded (sglang.srt.environ, ...) stay reachable as
    # attributes of their stood-in parents, as a real import would have bound them.
    for name, module in list(sys.modules.items()):
        parent, _, child = name.rpartition(".")
        if parent in STAND_INS:
            setattr(sys.modules[parent], child, module)


def load_backend() -> SimpleNamespace:
    """The backend's modules, by the short names of ``MODULES``; SGLang's packages are stood in
    only if the real import fails. Raises ``ImportError`` when SGLang is not installed."""
    if not installed():
        raise ImportError("sglang is not installed")
    try:
        importlib.import_module(f"{BACKEND}.kv_cache")
    except ImportError:
        _stand_in()
    return SimpleNamespace(
        **{short: importlib.import_module(name) for short, name in MODULES.items()}
    )
