"""Every command the README, the docs/ pages and the lab file headers give works as written from the
repository's root: `python -m ...` commands parse their arguments (`plan` runs to the end), pytest
commands collect tests, make targets, files, extras and lab numbers exist. A renamed flag, command,
target or file fails here, naming the page that still says it (tests/doc_commands.py extracts them)."""
import glob
import json
import re
import shlex
import subprocess
import sys
import tomllib


from tests.doc_commands import ROOT, commands
import pytest

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

LAUNCHER_VALUE_FLAGS = {"-n", "-np", "-f", "-ppn", "--hostfile"}
SKIP = ("apt-get", "srun", "scontrol", "source", "head=")
REPO_DIRS = ("configs/", "labs/", "solutions/", "tests/", "lessons/", "minizero/", "docs/")


def _python_argv(words: list[str]) -> list[str] | None:
    """The `python ...` part of a command (after mpirun's or torchrun's own options), without `python`."""
    if words[0] in ("mpirun", ".venv/bin/mpirun"):
        i = 1
        while i < len(words) and words[i].startswith("-"):
            i += 2 if words[i] in LAUNCHER_VALUE_FLAGS else 1
        words = words[i:]
    elif words[0] == "torchrun":
        i = 1
        while i < len(words) and words[i] != "-m":
            i += 1 if "=" in words[i] else 2
        return words[i:]
    if words and words[0] in ("python", ".venv/bin/python"):
        return words[1:]
    return None


def classify() -> dict[str, list]:
    """The documented commands sorted by how they are checked: {kind: [(where, command, detail)]}."""
    kinds: dict[str, list] = {"module": [], "file": [], "pytest": [], "make": [], "extra": [], "skipped": []}
    for where, command in commands():
        words = shlex.split(command)
        while words and re.match(r"^[A-Z_]+=\S*$", words[0]):  # an environment prefix
            words = words[1:]
        if not words or words[0].startswith(SKIP) or words[0] == "pip" and "-e" not in words:
            kinds["skipped"].append((where, command, None))
            continue
        python = _python_argv(words)
        if python == [] or python is None and words[0] in ("mpirun", "torchrun"):  # a launcher's options, quoted
            kinds["skipped"].append((where, command, None))
        elif python is not None:
            if python[:1] == ["-m"]:  # a command named without arguments in prose: it exists (--help)
                bare = len(python) <= (3 if python[1] in ("minizero", "minizero_course") else 2)
                kinds["module"].append((where, command, python + ["--help"] * bare))
            kinds["file"] += [(where, command, w) for w in python if w.startswith(REPO_DIRS)]
        elif words[0] == "pytest":
            kinds["pytest"].append((where, command, words[1:]))
            kinds["file"] += [(where, command, w) for w in words[1:] if w.startswith(REPO_DIRS)]
        elif words[0] == "make":
            # make's own VAR=value arguments (ARGS="--quick") are not targets
            kinds["make"] += [(where, command, target) for target in words[1:] if "=" not in target]
        elif words[0] == "pip":
            kinds["extra"].append((where, command, re.search(r"\.\[([\w,-]+)\]", command).group(1)))
        elif words[0] == "conda":
            kinds["file"].append((where, command, words[words.index("-f") + 1]))
        else:
            raise AssertionError(f"{where}: no rule checks `{command}`")
    return kinds


KINDS = classify()


def test_the_documented_commands_are_found():
    """The extraction itself: the README's two commands and a lab's run/grade lines are among them."""
    found = {c for _, c in commands()}
    assert {"make demo", "make test", "pytest -m lab1 --impl labs",
            "python -m minizero_course grade --lab 1 --impl labs",
            "mpirun -n 4 python labs/lab01_ring_allreduce.py"} <= found
    assert len(KINDS["module"]) >= 20, KINDS["module"]


def _run_checks(argvs: list[list[str]]) -> list[dict]:
    proc = subprocess.run([sys.executable, "tests/doc_commands.py", json.dumps(argvs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_every_python_module_command_parses():
    """Each `python -m MODULE ARGS` parses (plan runs; a command named without arguments answers --help); a
    flag renamed in the code fails here, and so does the planted bad flag, which shows the check can fail."""
    planted = ["-m", "minizero_course", "bench", "--no-such-flag"]
    argvs = sorted({tuple(["python", *p]) for _, _, p in KINDS["module"]}) + [("python", *planted)]
    where = {tuple(["python", *p]): (w, c) for w, c, p in KINDS["module"]}
    results = {tuple(r["argv"]): r for r in _run_checks([list(a) for a in argvs])}
    assert results[("python", *planted)]["code"] == 2 and "--no-such-flag" in results[("python", *planted)]["stderr"]
    failed = [f"{where[a][0]}: `{where[a][1]}` -> {r['status']} {r['code']}: {r['stderr'].strip()[:300]}"
              for a, r in results.items() if a != ("python", *planted) and r["code"]]
    assert not failed, "\n".join(failed)


def test_every_documented_file_target_extra_and_lab_exists():
    makefile = (ROOT / "Makefile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    missing = [f"{w}: `{c}`: no file {f}" for w, c, f in KINDS["file"]  # labNN_*.py: any lab
               if not glob.glob(str(ROOT / f.replace("NN", "[0-9][0-9]")))]
    missing += [f"{w}: `{c}`: no make target {t}" for w, c, t in KINDS["make"]
                if not re.search(rf"^{re.escape(t)}:", makefile, re.M)]
    missing += [f"{w}: `{c}`: no extra [{e}] in pyproject.toml" for w, c, e in KINDS["extra"]
                if any(name not in extras for name in e.split(","))]
    from minizero_course.grader import LABS
    for w, c, args in KINDS["pytest"]:
        for lab in re.findall(r"\blab(\d+)\b", " ".join(args)):
            if int(lab) not in LABS:
                missing.append(f"{w}: `{c}`: there is no lab {lab}")
    assert not missing, "\n".join(missing)


def test_the_pytest_commands_collect_from_the_root():
    """Each distinct pytest command (lab numbers folded into one) collects tests when run, as written,
    from the repository's root: `pytest -m lab1 --impl labs` needs the root conftest.py's option."""
    shapes = sorted({tuple(re.sub(r"\blab\d+\b", "lab1", a) for a in args) for _, _, args in KINDS["pytest"]})
    assert ("-m", "lab1", "--impl", "labs") in shapes
    for args in shapes:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and re.search(r"\b[1-9]\d* tests? collected|^\d+/\d+ tests collected",
                                                   proc.stdout, re.M), (args, proc.stdout[-1500:], proc.stderr[-1500:])


def test_make_check_selects_no_test_that_starts_processes():
    """`make check` (-m "not launches") is the fast part: no lesson run, site build, lab check or launch in it,
    and still the package's own tests (a marker rule that swallowed everything would pass the first half)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                           "not launches"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    slow = ("test_lessons.py::test_lesson_executes", "test_site.py::", "test_stretch_untouched.py::",
            "test_mutants.py::test_mutant", "test_labs.py::", "test_launchers.py::", "test_grader.py::test_solutions")
    assert not [i for i in ids if any(s in i for s in slow)], [i for i in ids if any(s in i for s in slow)][:5]
    assert len(ids) >= 300 and any("test_lessons.py::test_no_lesson_shows_a_solution" in i for i in ids), len(ids)


def test_every_make_target_is_a_command():
    """Every target of the Makefile is a command, none names a file: without .PHONY, `make site` with site/
    present (as after `make test`) would say "'site' is up to date" and build nothing."""
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):(?!=)", makefile, re.M))
    phony = {t for line in re.findall(r"^\.PHONY:(.*)$", makefile, re.M) for t in line.split()}
    assert {"site", "test", "check", "demo"} <= targets and not targets - phony, sorted(targets - phony)
