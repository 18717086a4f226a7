"""The package's layout: imports point one way, and every public name resolves.

Layers, lowest first: ops (ops.py and the extension) < caches < attention < families < decoding
< integrations < server. A module may import its own layer and the layers below it, never one
above; tools are leaves that any layer may use and that import only ops and tools. The modules at
the package root (``__init__``, ``__main__``, ``serve``, ``mlx_lm``, ``sglang``) are the public
face and may import anything. A module below them may look up the fused ops on the root package at
call time (``import mlx_batched_decode``, then ``mlx_batched_decode.batched_decode_attention``, so
that a replaced public op is the one called), but nothing else of it.
"""

import ast
from pathlib import Path

import mlx_batched_decode
import mlx_batched_decode.mlx_lm
import mlx_batched_decode.sglang
from mlx_batched_decode import ops
from tests.support.repo import REPO

PACKAGE = "mlx_batched_decode"
SOURCE = REPO / "python" / PACKAGE
RANKS = {
    "ops": 0, "_ext": 0, "caches": 1, "attention": 2, "families": 3, "decoding": 4,
    "integrations": 5, "server": 6,
}
TOOLS = "tools"
FACE = "face"


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package below ``root``, by its dotted name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    names[f"{PACKAGE}._ext"] = root / "_ext"
    return names


def layer(module: str) -> str:
    """The layer a dotted module name belongs to: a key of RANKS, TOOLS or FACE."""
    parts = module.split(".")
    if len(parts) > 1 and (parts[1] in RANKS or parts[1] == TOOLS):
        return parts[1]
    return FACE


def allowed(source: str, target: str) -> bool:
    """Whether a module of layer ``source`` may import a module of layer ``target``."""
    if source == FACE or target == TOOLS:
        return True
    if source == TOOLS:
        return target == "ops" or target == "_ext"
    return target != FACE and RANKS[target] <= RANKS[source]


def imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str, str]]:
    """``(line, imported module, name)`` for every import of the package in ``path``, lazy
    ones included; ``name`` is the name taken from the root package (``""`` otherwise)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "") for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    found.append((node.lineno, submodule, ""))
                else:
                    found.append((node.lineno, target, alias.name if target == PACKAGE else ""))
    return found


def root_lookups(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` for every ``mlx_batched_decode.<name>`` attribute read in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == PACKAGE
    ]


def violations(modules: dict[str, Path]) -> list[str]:
    """Every import against the layering, as ``module:line imports target``."""
    found = []
    for module, path in modules.items():
        source = layer(module)
        if source == FACE or not path.suffix:
            continue
        takes_root = False
        for line, target, name in imports(module, path, modules):
            where = f"{module}:{line}"
            if target == PACKAGE:
                # The root package: only for the fused ops, looked up at call time.
                takes_root = True
                if name and name not in ops.__all__:
                    found.append(f"{where} imports {name} from the package root")
            elif not allowed(source, layer(target)):
                found.append(f"{where} ({source}) imports {target} ({layer(target)})")
        if takes_root:
            found += [
                f"{module}:{line} reads {PACKAGE}.{name}, not an op"
                for line, name in root_lookups(path)
                if name not in ops.__all__
            ]
    return found


def test_imports_point_one_way():
    assert violations(module_names(SOURCE)) == []


def test_the_check_finds_an_upward_import(tmp_path):
    # A copy of the package with one upward and one root-package import added.
    for path in SOURCE.rglob("*.py"):
        copy = tmp_path / path.relative_to(SOURCE)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    with open(tmp_path / "caches" / "context.py", "a") as f:
        f.write("\n\ndef _upward():\n    from ..decoding.decoder import BatchedDecoder\n")
    with open(tmp_path / "tools" / "progress.py", "a") as f:
        f.write("\nfrom .. import BatchedDecoder\nfrom ..caches import kv_cache\n")
    found = violations(module_names(tmp_path))
    assert any(v.startswith(f"{PACKAGE}.caches.context:") and "decoding.decoder" in v for v in found)
    assert any("imports BatchedDecoder from the package root" in v for v in found)
    assert any(v.startswith(f"{PACKAGE}.tools.progress:") and "caches.kv_cache" in v for v in found)


def test_every_public_name_resolves():
    for module in (mlx_batched_decode, mlx_batched_decode.mlx_lm, mlx_batched_decode.sglang, ops):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == [], f"{module.__name__}.__all__ names what it lacks: {missing}"
    for name in ops.__all__:
        assert getattr(mlx_batched_decode, name) is getattr(ops, name)


ENGINE = f"{PACKAGE}.decoding"


def private_engine_imports(paths: list[Path]) -> list[str]:
    """Every import of a private name (or private module) of the decoding layer in ``paths``,
    as ``path:line imports name``; relative imports resolve against the package's source."""
    found = []
    for path in paths:
        inside = path.is_relative_to(SOURCE)
        if inside and path.relative_to(SOURCE).parts[0] == "decoding":
            continue
        module = ".".join([PACKAGE, *path.relative_to(SOURCE).with_suffix("").parts]) if inside else ""
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level and inside:
                    base = module.split(".")[: -node.level]
                    target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if name.startswith(ENGINE) and any(p.startswith("_") for p in parts[2:]):
                    found.append(f"{path}:{node.lineno} imports {name}")
    return found


def engine_users() -> list[Path]:
    """The package's modules, the tests and the benchmarks."""
    return [p for root in (SOURCE, REPO / "tests", REPO / "benchmarks") for p in root.rglob("*.py")]


def test_nothing_outside_the_engine_imports_its_private_names():
    assert private_engine_imports(engine_users()) == []


def test_the_check_finds_a_private_engine_import(tmp_path):
    user = tmp_path / "user.py"
    user.write_text(
        "from mlx_batched_decode.decoding.scheduler import _hidden\n"
        "import mlx_batched_decode.decoding._private_module\n"
        "from mlx_batched_decode.decoding.scheduler import Scheduler\n"
    )
    found = private_engine_imports([user])
    assert [f.split(" imports ")[1] for f in found] == [
        f"{ENGINE}.scheduler._hidden", f"{ENGINE}._private_module"
    ]
