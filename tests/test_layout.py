"""The layers flow one way, and the library never leans on the course.

minizero/ is the library. Mechanisms import only comm, memory, precision, host, env and their own
subpackage; runtime/ never imports the tools above it or the course's models and data; each tool
(planner, launcher, accelerate, cli) imports only the layers below it (TOOLS).
minizero_course/ is the course around it: the grader, the lab kit, the lessons' experiments and
the benches (COURSE). The course imports the library, the library never imports the course, not
even inside a function. No import circle either: not between two parts of the library (a folder or
a top-level module), not between the course's folders, not between two modules of one folder.
Imports inside functions count everywhere: a lazy import is still a dependency. A layer's folder
with no module fails: an empty folder would pass every check silently."""
import ast
import pathlib

import pytest

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "minizero"
COURSE_PKG = ROOT / "minizero_course"
# ops: DeepSpeed's optimizer names (deepspeed.ops.adam) over torch's, a leaf like a mechanism
MECHANISMS = ("comm", "dp", "zero", "pipeline", "tensor", "context", "moe", "compression", "sparse",
              "ops")
SHARED = ("minizero.comm", "minizero.memory", "minizero.precision", "minizero.host",
          "minizero.env")  # env: the one place MINIZERO_* variables are read and checked
ABOVE = ("minizero.cli", "minizero.models", "minizero.data", "minizero.launch")
BELOW_TOOLS = SHARED + tuple(f"minizero.{m}" for m in MECHANISMS) + (
    "minizero.activation_checkpointing", "minizero.models", "minizero.data", "minizero.launch")
# The argparse types and output-path checks every command shares (the course's commands too); a
# leaf: it imports nothing of minizero (test_cli_checks_is_a_leaf).
CHECKS = ("minizero.cli.checks",)
# What each of the library's tools may import besides itself, from the bottom up.
TOOLS = {
    "planner": SHARED + tuple(f"minizero.{m}" for m in MECHANISMS),
    # DeepSpeed's launcher (python -m minizero.launcher): starts mpirun or torchrun, nothing of the
    # engine
    "launcher": SHARED + ("minizero.launch",),
    # Accelerate's front door (python -m minizero.accelerate.launch starts mpirun): the engine, the
    # launcher's mpirun, nothing above
    "accelerate": SHARED + ("minizero.runtime", "minizero.launch"),
    "cli": BELOW_TOOLS + ("minizero.runtime", "minizero.planner"),
}
# What each folder of the course may import besides itself. Experiments (what lessons and lab checks
# launch) import no other part of the course; the grader does not import the kit that hands it out.
COURSE = {
    "experiments": BELOW_TOOLS + ("minizero.runtime", "minizero.planner"),
    "bench": BELOW_TOOLS + ("minizero.runtime", "minizero_course.experiments") + CHECKS,
    "grader": BELOW_TOOLS + ("minizero_course.experiments",) + CHECKS,
    "kit": CHECKS + ("minizero_course.grader",),
}


def imports(source: str) -> set[str]:
    """Every minizero or minizero_course module a source imports, at any depth (lazy imports inside
    functions too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] in ("minizero", "minizero_course")}


def _within(module, prefixes):
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(folder: str, source: str, package: str = "minizero") -> list[str]:
    own = f"{package}.{folder}"
    bad = []
    for module in sorted(imports(source)):
        if module == "minizero" or module.startswith("minizero.__"):
            continue
        if package == "minizero" and _within(module, ("minizero_course",)):
            bad.append(module)  # the library never imports the course
        elif package == "minizero" and folder in MECHANISMS:
            # "from minizero import memory" shows up as minizero.memory: judged like any module
            if not _within(module, SHARED + (own,)):
                bad.append(module)
        elif folder in (TOOLS if package == "minizero" else COURSE):
            allowed = (TOOLS if package == "minizero" else COURSE)[folder] + (own,)
            # "from minizero.cli import checks" also names the package minizero.cli: its __init__ is
            # checked by test_cli_checks_is_a_leaf
            if not _within(module, allowed) and not any(a.startswith(module + ".")
                                                        for a in allowed):
                bad.append(module)
        elif _within(module, ABOVE):
            bad.append(module)
    return bad


def modules(folder: str, root: pathlib.Path | None = None) -> list[pathlib.Path]:
    root = PKG if root is None else root  # read at each call: test_an_empty_layer_fails moves it
    return sorted((root / folder).glob("*.py")) if (root / folder).is_dir() else []


@pytest.mark.parametrize("folder", MECHANISMS + ("runtime",) + tuple(TOOLS))
def test_layers_flow_one_way(folder):
    files = modules(folder)
    assert [f for f in files if f.name != "__init__.py"], f"minizero/{folder}/ has no modules"
    found = {f"{folder}/{f.name}": violations(folder, f.read_text()) for f in files}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


@pytest.mark.parametrize("folder", tuple(COURSE))
def test_the_courses_layers_flow_one_way(folder):
    files = modules(folder, COURSE_PKG)
    assert [f for f in files if f.name != "__init__.py"], (
        f"minizero_course/{folder}/ has no modules")
    found = {f"{folder}/{f.name}": violations(folder, f.read_text(), "minizero_course")
             for f in files}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_the_library_never_imports_the_course():
    """Every module of minizero/, the top-level ones and every folder's, at any depth."""
    found = {str(f.relative_to(ROOT)): sorted(m for m in imports(f.read_text())
                                              if _within(m, ("minizero_course",)))
             for f in sorted(PKG.rglob("*.py"))}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_every_subpackage_is_a_known_layer():
    """A new folder under minizero/ or minizero_course/ must be given its place here, or it would go
    unchecked."""
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(MECHANISMS) | {"runtime"} | set(TOOLS)
    course = {p.name for p in COURSE_PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert course == set(COURSE)


def test_cli_checks_is_a_leaf():
    """What a tool loads with cli.checks: checks.py and the package's __init__, which reads env
    only."""
    assert imports((PKG / "cli" / "checks.py").read_text()) == set()
    assert imports((PKG / "cli" / "__init__.py").read_text()) - {"minizero"} == {"minizero.env"}


# ----------------------------------------------------------------------------- import circles
def _module_names(package: pathlib.Path) -> dict[str, pathlib.Path]:
    names = {}
    for f in package.rglob("*.py"):
        parts = f.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return names


def import_graph(package: pathlib.Path, node) -> dict[str, dict[str, str]]:
    """{a: {b: 'file:line'}}: some module of node a imports some module of node b (a != b), where
    node(module) names the part a module belongs to, or None to leave the module out."""
    names = _module_names(package)
    graph = {}
    for name, f in names.items():
        a = node(name)
        if a is None:
            continue
        for stmt in ast.walk(ast.parse(f.read_text())):
            if isinstance(stmt, ast.Import):
                targets = [al.name for al in stmt.names]
            elif isinstance(stmt, ast.ImportFrom) and stmt.module:
                # "from minizero.zero import zeropp" imports the module zeropp, not only the package
                targets = [f"{stmt.module}.{al.name}" for al in stmt.names]
            else:
                continue
            for target in targets:
                while target and target not in names:  # a name inside a module: that module
                    target = target.rpartition(".")[0]
                b = node(target) if target else None
                if b is not None and b != a:
                    where = f"{f.relative_to(package.parent)}:{stmt.lineno}"
                    graph.setdefault(a, {}).setdefault(b, where)
    return graph


def circle(graph: dict[str, dict[str, str]]) -> list[str]:
    """One import circle of the graph, as 'a -> b (file:line)' steps; [] when there is none."""
    state, path = {}, []

    def visit(a):
        state[a] = "open"
        path.append(a)
        for b in graph.get(a, {}):
            if state.get(b) == "open":
                loop = path[path.index(b):] + [b]
                return [f"{x} -> {y} ({graph[x][y]})" for x, y in zip(loop, loop[1:])]
            if b not in state and (found := visit(b)):
                return found
        state[a] = "done"
        path.pop()
        return []

    for a in sorted(graph):
        if a not in state and (found := visit(a)):
            return found
    return []


def _part(name: str):
    """The library's parts: each folder and each top-level module (the package's own __init__, the
    DeepSpeed-like front door that gathers every part, and __main__ are left out)."""
    parts = name.split(".")
    return None if len(parts) < 2 or parts[1].startswith("__") else ".".join(parts[:2])


def test_no_import_circle_between_the_librarys_parts():
    assert circle(import_graph(PKG, _part)) == []


def test_no_import_circle_between_the_courses_folders():
    assert circle(import_graph(COURSE_PKG, _part)) == []


def _in_folder(folder: str):
    """The modules of one folder; a folder's __init__ is left out: it is the folder's index, which
    gathers its modules' names, and they may read shared names from it."""
    def node(name):
        inside = name.startswith(folder + ".") and name.count(".") == folder.count(".") + 1
        return name if inside else None
    return node


FOLDERS = sorted({".".join(f.relative_to(ROOT).parent.parts) for pkg in (PKG, COURSE_PKG)
                  for f in pkg.rglob("*.py") if f.name != "__init__.py"})


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_import_circle_within_a_folder(folder):
    package = PKG if folder.split(".")[0] == "minizero" else COURSE_PKG
    assert circle(import_graph(package, _in_folder(folder))) == []


# ----------------------------------------------------------------------------- the checks can fail
def test_the_check_catches_an_upward_import():
    assert violations("zero", "from minizero.models import TinyGPT") == [
        "minizero.models", "minizero.models.TinyGPT"]
    assert violations("dp", "def f():\n    from minizero import data\n") == ["minizero.data"]
    assert violations("zero", "from minizero.dp import DDP") == ["minizero.dp", "minizero.dp.DDP"]
    assert violations("runtime", "from minizero.cli.train import main")
    assert violations("runtime", "from minizero.zero import FSDP") == []
    assert violations("zero", "from minizero import comm as comm_mod\n"
                              "from minizero.zero.flat_layout import FlatLayout") == []
    assert violations("planner", "from minizero.runtime import engine") == [
        "minizero.runtime", "minizero.runtime.engine"]
    assert violations("cli", "from minizero.planner import plan") == []


def test_the_check_catches_the_library_importing_the_course():
    lazy = "def f():\n    from minizero_course.experiments import references\n"
    assert violations("cli", lazy) == ["minizero_course.experiments",
                                       "minizero_course.experiments.references"]
    assert violations("runtime", "import minizero_course.grader") == ["minizero_course.grader"]
    assert violations("comm", "from minizero_course import bench") == [
        "minizero_course", "minizero_course.bench"]
    assert imports("def f():\n    import minizero_course.kit.handout\n") == {
        "minizero_course.kit.handout"}


def test_the_check_catches_a_course_layer_out_of_place():
    course = "minizero_course"
    lazy = "def f():\n    from minizero_course.kit import handout\n"
    assert violations("grader", lazy, course) == ["minizero_course.kit",
                                                  "minizero_course.kit.handout"]
    assert violations("experiments", "from minizero_course.bench import common", course) == [
        "minizero_course.bench", "minizero_course.bench.common"]
    assert violations("grader", "from minizero.cli import checks", course) == []
    assert violations("grader", "from minizero.cli import train", course) == ["minizero.cli.train"]
    assert violations("kit", "from minizero_course.grader import LABS", course) == []


def test_the_circle_check_finds_a_circle(tmp_path):
    pkg = tmp_path / "minizero"
    (pkg / "comm").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from minizero import env\n")
    (pkg / "comm" / "__init__.py").write_text("from minizero.comm.launcher import launched_rank\n")
    (pkg / "comm" / "launcher.py").write_text("import os\n")
    (pkg / "env.py").write_text("def check():\n"
                                "    from minizero.comm.launcher import launched_rank\n")
    assert circle(import_graph(pkg, _part)) == []  # env -> comm only
    (pkg / "comm" / "launcher.py").write_text("def f():\n    from minizero import env\n")
    found = circle(import_graph(pkg, _part))
    assert [step.split(" (")[0] for step in found] == ["minizero.comm -> minizero.env",
                                                       "minizero.env -> minizero.comm"]
    assert found[0].endswith("(minizero/comm/launcher.py:2)"), found
    triangle = {"a": {"b": "x"}, "b": {"c": "y"}, "c": {"a": "z"}}
    assert circle(triangle) == ["a -> b (x)", "b -> c (y)", "c -> a (z)"]


def test_an_empty_layer_fails(tmp_path, monkeypatch):
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PKG", tmp_path)
    with pytest.raises(AssertionError, match="minizero/moe/ has no modules"):
        test_layers_flow_one_way("moe")
