"""The layers flow one way: mechanisms import only comm, memory, precision, env and their own
subpackage; nothing under comm/, dp/, zero/, pipeline/, tensor/, context/, compression/, sparse/ or runtime/ imports the tools
above them (bench, experiments, cli, autograde) or the course's models and data."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "minizero"
MECHANISMS = ("comm", "dp", "zero", "pipeline", "tensor", "context", "moe", "compression", "sparse")
SHARED = ("minizero.comm", "minizero.memory", "minizero.precision",
          "minizero.env")  # env: the one place MINIZERO_* variables are read and checked
ABOVE = ("minizero.bench", "minizero.experiments", "minizero.cli", "minizero.autograde",
         "minizero.models", "minizero.data", "minizero.launch")


def imports(source: str) -> set[str]:
    """Every minizero module a source imports, at any depth (lazy imports inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m == "minizero" or m.startswith("minizero.")}


def _within(module, prefixes):
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(folder: str, source: str) -> list[str]:
    own = f"minizero.{folder}"
    bad = []
    for module in sorted(imports(source)):
        if module == "minizero" or module.startswith("minizero.__"):
            continue
        if folder in MECHANISMS:
            # "from minizero import memory" shows up as minizero.memory: judged like any module
            if not _within(module, SHARED + (own,)):
                bad.append(module)
        elif _within(module, ABOVE):
            bad.append(module)
    return bad


@pytest.mark.parametrize("folder", MECHANISMS + ("runtime",))
def test_layers_flow_one_way(folder):
    files = sorted((PKG / folder).glob("*.py")) if (PKG / folder).is_dir() else []
    if folder in ("comm", "dp", "zero", "runtime"):
        assert files, f"minizero/{folder}/ has no modules"
    found = {f"{folder}/{f.name}": violations(folder, f.read_text()) for f in files}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_the_check_catches_an_upward_import():
    assert violations("zero", "from minizero.models import TinyGPT") == ["minizero.models", "minizero.models.TinyGPT"]
    assert violations("dp", "def f():\n    from minizero import data\n") == ["minizero.data"]
    assert violations("zero", "from minizero.dp import DDP") == ["minizero.dp", "minizero.dp.DDP"]
    assert violations("runtime", "from minizero.experiments.references import train_single")
    assert violations("runtime", "from minizero.zero import FSDP") == []
    assert violations("zero", "from minizero import comm as comm_mod\nfrom minizero.zero.flat_layout import FlatLayout") == []
