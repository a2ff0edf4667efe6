"""The layers flow one way. Mechanisms import only comm, memory, precision, env and their own
subpackage; runtime/ never imports the tools above it or the course's models and data; each tool
(planner, experiments, bench, autograde, cli) imports only the layers below it (TOOLS). A layer's
folder with no module fails: an empty folder would pass every check silently."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "minizero"
# ops: DeepSpeed's optimizer names (deepspeed.ops.adam) over torch's, a leaf like a mechanism
MECHANISMS = ("comm", "dp", "zero", "pipeline", "tensor", "context", "moe", "compression", "sparse", "ops")
SHARED = ("minizero.comm", "minizero.memory", "minizero.precision", "minizero.host",
          "minizero.env")  # env: the one place MINIZERO_* variables are read and checked
ABOVE = ("minizero.bench", "minizero.experiments", "minizero.cli", "minizero.autograde",
         "minizero.models", "minizero.data", "minizero.launch")
BELOW_TOOLS = SHARED + tuple(f"minizero.{m}" for m in MECHANISMS) + (
    "minizero.activation_checkpointing", "minizero.models", "minizero.data", "minizero.launch")
# The argparse types and output-path checks every command shares (autograde's and bench's own mains
# too); a leaf: it imports nothing of minizero (test_cli_checks_is_a_leaf).
CHECKS = ("minizero.cli.checks",)
# What each tool may import besides itself, from the bottom up. Never the other way: the grader
# does not import the command line (its lab generator lives in autograde/labgen.py), and
# experiments (what lessons and graders launch) import no tool.
TOOLS = {
    "planner": SHARED + tuple(f"minizero.{m}" for m in MECHANISMS),
    # DeepSpeed's launcher (python -m minizero.launcher): starts mpirun or torchrun, nothing of the engine
    "launcher": SHARED + ("minizero.launch",),
    # Accelerate's front door (python -m minizero.accelerate.launch starts mpirun): the engine, the launcher's
    # mpirun, nothing above
    "accelerate": SHARED + ("minizero.runtime", "minizero.launch"),
    "experiments": BELOW_TOOLS + ("minizero.runtime", "minizero.planner"),
    "bench": BELOW_TOOLS + ("minizero.runtime", "minizero.experiments") + CHECKS,
    "autograde": BELOW_TOOLS + ("minizero.experiments",) + CHECKS,
    "cli": BELOW_TOOLS + ("minizero.runtime", "minizero.planner", "minizero.experiments", "minizero.bench",
                          "minizero.autograde"),
}


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
        elif folder in TOOLS:
            allowed = TOOLS[folder] + (own,)
            # "from minizero.cli import checks" also names the package minizero.cli: its __init__ is
            # checked by test_cli_checks_is_a_leaf
            if not _within(module, allowed) and not any(a.startswith(module + ".") for a in allowed):
                bad.append(module)
        elif _within(module, ABOVE):
            bad.append(module)
    return bad


def modules(folder: str) -> list[pathlib.Path]:
    return sorted((PKG / folder).glob("*.py")) if (PKG / folder).is_dir() else []


@pytest.mark.parametrize("folder", MECHANISMS + ("runtime",) + tuple(TOOLS))
def test_layers_flow_one_way(folder):
    files = modules(folder)
    assert [f for f in files if f.name != "__init__.py"], f"minizero/{folder}/ has no modules"
    found = {f"{folder}/{f.name}": violations(folder, f.read_text()) for f in files}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_every_subpackage_is_a_known_layer():
    """A new folder under minizero/ must be given its place here, or it would go unchecked."""
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(MECHANISMS) | {"runtime"} | set(TOOLS)


def test_cli_checks_is_a_leaf():
    """What a tool loads with cli.checks: checks.py and the package's __init__, which reads env only."""
    assert imports((PKG / "cli" / "checks.py").read_text()) == set()
    assert imports((PKG / "cli" / "__init__.py").read_text()) - {"minizero"} == {"minizero.env"}


def test_the_check_catches_an_upward_import():
    assert violations("zero", "from minizero.models import TinyGPT") == ["minizero.models", "minizero.models.TinyGPT"]
    assert violations("dp", "def f():\n    from minizero import data\n") == ["minizero.data"]
    assert violations("zero", "from minizero.dp import DDP") == ["minizero.dp", "minizero.dp.DDP"]
    assert violations("runtime", "from minizero.experiments.references import train_single")
    assert violations("runtime", "from minizero.zero import FSDP") == []
    assert violations("zero",
                      "from minizero import comm as comm_mod\nfrom minizero.zero.flat_layout import FlatLayout") == []
    assert violations("autograde", "def f():\n    from minizero.cli import labgen\n") == ["minizero.cli.labgen"]
    assert violations("autograde", "from minizero.cli import checks") == []
    assert violations("experiments", "from minizero.bench import common") == ["minizero.bench",
                                                                               "minizero.bench.common"]
    assert violations("planner", "from minizero.runtime import engine") == ["minizero.runtime",
                                                                             "minizero.runtime.engine"]
    assert violations("cli", "from minizero.autograde import LABS") == []


def test_an_empty_layer_fails(tmp_path, monkeypatch):
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PKG", tmp_path)
    with pytest.raises(AssertionError, match="minizero/moe/ has no modules"):
        test_layers_flow_one_way("moe")
