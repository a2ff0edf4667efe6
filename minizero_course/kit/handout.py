"""python -m minizero_course handout OUT [--labs 1-6]: the student's copy of the course.

OUT is this repository as a student gets it: no solutions/, and in the package itself each SOLUTION
region of the chosen labs replaced by its stub (labgen.transform: the same TODO and hints as labs/),
so the student writes the code in the files the lessons import. The other labs' regions keep their
code (markers dropped): the package works for everything the handout does not ask for.
  * labs/labNN_*.py: launchers that run a lab's demo on the package (`mpirun -n 4 python labs/...`);
  * minizero_course/grader/handout.json: the chosen labs and each untouched lab's fingerprint, so that
    `python -m minizero_course grade` grades the package (impl 'package') and scores an untouched lab 0 at once;
  * each lesson that runs code of a chosen lab starts with a note saying so: run it after lab N;
  * a short Makefile: setup, demo, test (STUDENT_TESTS: what holds before any lab is done), grade.
Left out: what grades or generates from the solutions (STAFF_ONLY).
"""
import json
import os
import re
import shutil
import subprocess
import tempfile
import sys

from minizero_course.grader import LABS, REPO, tree_digest
from minizero_course.grader import labgen

# The course's own tooling: it reads solutions/ or the SOLUTION markers, which a handout has neither of;
# and the instructor's answer keys and rubrics (instructors/), with the test that checks them.
STAFF_ONLY = ("solutions/", "labs/", "tests/mutants/", "tests/test_mutants.py", "tests/test_grader.py",
              "tests/test_site.py", "tests/test_handout.py", "tests/test_gradescope.py", ".github/",
              "instructors/", "tests/test_instructor_keys.py")
# `make test` in a handout: cheap checks that hold before any lab is done (each needs no stubbed code): the
# lessons are committed clean and show no solution, the configs, models and memory estimator work. The lab
# checks are `make grade` / `pytest tests -m labN`; the rest of tests/ checks the package as labs are done.
STUDENT_TESTS = ("tests/test_lessons.py::test_committed_without_outputs",
                 "tests/test_lessons.py::test_no_lesson_shows_a_solution",
                 "tests/test_config.py", "tests/test_models_data.py", "tests/test_plan.py")
# The lab each lesson leads to, in course order (lesson 11, 3D parallelism, composes labs 9 and 10). A lesson
# runs the package's code of its topic and of the topics before it, so a handout marks it "after lab N" for
# the last chosen lab up to its own: a conservative rule (a lesson may not call every earlier lab's code).
LESSON_TOPIC = {"00": 0, "01": 1, "02": 2, "03": 3, "04": 4, "05": 5, "06": 6, "07": 7, "08": 8, "09": 9,
                "10": 10, "11": 10, "12": 11, "13": 12, "14": 13, "15": 14}


def _all_labs() -> str:
    """Every lab as --labs takes it: runs of consecutive numbers as a-b (a number may be missing: 1-12,14)."""
    return _as_ranges(LABS, ",")


def _as_ranges(numbers, sep: str) -> str:
    """Runs of consecutive numbers as a-b: [0, 15, 16, 17] -> '0, 15-17' with sep ', '."""
    runs = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return sep.join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def parse_labs(text: str) -> list[int]:
    """'1-6', '1,3,8' or '2-4,9' -> sorted lab numbers; anything else is a clear error."""
    labs = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise ValueError(f"--labs {text!r}: use numbers and ranges, e.g. 1-6 or 1,3,8")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        labs |= set(range(lo, hi + 1))
    unknown = sorted(labs - set(LABS))
    if unknown or not labs:
        named = _as_ranges(unknown, ", ") or text  # 0, 15-99 rather than 86 numbers
        raise ValueError(f"--labs {text!r}: no lab {named}; the labs are {_all_labs()}")
    return sorted(labs)


def repository_files(root: str = REPO) -> list[str]:
    """The repository's files as a clone has them: tracked, plus new ones git does not ignore."""
    out = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         capture_output=True, text=True, check=True).stdout
    return sorted(p for p in out.split("\0") if p and os.path.isfile(os.path.join(root, p)))


def launcher(lab) -> str:
    """A handout's labs/labNN_*.py: the lab's header, and its demo run on the package (the student's code)."""
    paths = labgen.sources(lab)
    return (f"# Lab {lab.number:02d}: {lab.title}\n"
            f"# Write the TODO(lab {lab.number}) regions of {' and '.join(paths)}: the package the lessons import.\n"
            f"#   run:   mpirun -n {lab.nprocs} python labs/{lab.filename}\n"
            f"#   check: python -m minizero_course grade --lab {lab.number}"
            f"    (or: pytest tests -m lab{lab.number})\n\n"
            "if __name__ == \"__main__\":\n"
            "    from minizero_course.grader import lab_main, package_namespace\n"
            f"    lab_main({lab.number}, package_namespace({lab.number}, __file__))\n")


def lesson_note(needs: list[int]) -> str:
    """The note a lesson that runs a chosen lab's code starts with."""
    n = needs[-1]
    labs = ", ".join(map(str, needs))
    return (f"> **After lab {n}.** This lesson runs your package, including code that "
            f"lab{'s' if len(needs) > 1 else ''} {labs} ask{'' if len(needs) > 1 else 's'} you to write. Until then, a "
            "cell that reaches a part you have not written stops with `lab K: not implemented yet: ...`; once `python "
            f"-m minizero_course grade --lab {n}` passes, its numbers are your code's.")


def students_files(text: str) -> str:
    """A lesson's "write it in labs/labNN_*.py" names, in the handout, the module(s) the student
    writes (its labs/ holds only each lab's demo launcher)."""
    for lab in LABS.values():
        where = "`, `".join(labgen.sources(lab))
        for before in ("in `{}`", "`{}` ("):
            text = text.replace(before.format(f"labs/{lab.filename}"), before.format(where))
    return text


def mark_lesson(text: str, needs: list[int]) -> str:
    nb = json.loads(text)
    nb["cells"].insert(1, {"cell_type": "markdown", "id": "handout-note", "metadata": {},
                           "source": lesson_note(needs).splitlines(keepends=True)})
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def makefile(labs: list[int]) -> str:
    which = ", ".join(map(str, labs))
    return f"""# The student's copy of minizero (labs {which}): write the TODO(lab N) regions in minizero/.
#   make demo    4 ranks train a tiny GPT           make test    quick checks of this copy
#   make grade   grade your labs (results.json)     mpirun -n 4 python labs/labNN_*.py   run a lab's demo
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED = 1
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup demo test grade clean

setup: $(STAMP)

$(STAMP): pyproject.toml
\t@test -x $(PY) || $(PYTHON) -m venv $(VENV)
\t$(PY) -m pip install --quiet --upgrade pip
\t$(PY) -m pip install --quiet -e ".[dev]"
\t$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
\t@touch $(STAMP)

demo: setup
\t$(PY) -m minizero demo

# Holds before any lab is done; `pytest tests -m labN` grades lab N, the rest of tests/ checks the package.
test: setup
\t$(PY) -m pytest -q {' '.join(STUDENT_TESTS)}

grade: setup
\t$(PY) -m minizero_course grade --json results.json || true  # below full marks is a result, not a failure

clean:
\trm -rf $(VENV) results.json demo.png runs build
"""


def readme(labs: list[int]) -> str:
    """The handout's README: only commands that exist in the handout (tests/test_handout.py runs
    each)."""
    rows = "\n".join(f"| {n} | {LABS[n].title} | `{'`, `'.join(labgen.sources(LABS[n]))}` |" for n in labs)
    first = LABS[labs[0]]
    demo = f".venv/bin/mpirun -n {first.nprocs} .venv/bin/python labs/{first.filename}"
    return f"""# Your copy of minizero

A course on how large models are trained across many GPUs, and a reference package you complete:
each `TODO(lab N)` in the files below replaces the reference code with a `raise
NotImplementedError`. The lessons import these files, so a lesson that needs a lab says so at its
top.

| lab | title | write the TODOs in |
|---|---|---|
{rows}

## Commands

```bash
# creates .venv (the first run takes a few minutes), then 4 ranks train a tiny GPT
make demo
# quick checks of this copy (they hold before any lab is done)
make test
# grades lab {first.number} where you wrote it (make grade: every lab, into results.json)
.venv/bin/python -m minizero_course grade --lab {first.number}
make grade
# lab {first.number}'s demo, on your code
{demo}
# the lessons: open one, then Run -> Run All Cells
.venv/bin/jupyter lab lessons/
```

Every command runs in this folder. A lab's grade names the check that failed and its likely
cause; the grader runs your code on 2 to 8 ranks of this machine's CPU.

## Keeping your work

This folder is not a git repository yet. Make it one before you start, so that every step can be
undone:

```bash
git init -q && git add -A && git commit -q -m "the handout as given"
```
"""


def build(out: str, labs: list[int], root: str = REPO) -> dict:
    """Write the handout into `out` (must not exist); return {kind: [paths]} of what changed."""
    files = repository_files(root)
    sources = {path: n for n, lab in LABS.items() for path in labgen.sources(lab)}
    changed = {"stubbed": [], "unmarked": [], "lessons": [], "added": [], "left out": []}
    os.makedirs(out)
    try:
        for path in files:
            if path.startswith(STAFF_ONLY):
                changed["left out"].append(path)
                continue
            dest = os.path.join(out, path)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if path in sources:
                with open(os.path.join(root, path)) as f:
                    text = f.read()
                n = sources[path]
                with open(dest, "w") as f:
                    f.write(labgen.transform(text, n, stub=n in labs))
                changed["stubbed" if n in labs else "unmarked"].append(path)
            elif path.startswith("lessons/") and path.endswith(".ipynb"):
                needs = [n for n in labs if n <= LESSON_TOPIC.get(os.path.basename(path)[:2], 0)]
                with open(os.path.join(root, path)) as f:
                    text = f.read()
                with open(dest, "w") as f:
                    text = students_files(text)
                    f.write(mark_lesson(text, needs) if needs else text)
                if needs:
                    changed["lessons"].append(f"{path} (after lab {needs[-1]})")
            elif path == "Makefile":
                with open(dest, "w") as f:
                    f.write(makefile(labs))
                changed["unmarked"].append(path)
            elif path == "README.md":  # the course's README is the instructor's: theirs
                with open(dest, "w") as f:
                    f.write(readme(labs))
                changed["unmarked"].append(path)
            else:
                shutil.copy2(os.path.join(root, path), dest)
        for n in labs:
            lab = LABS[n]
            os.makedirs(os.path.join(out, "labs"), exist_ok=True)
            with open(os.path.join(out, "labs", lab.filename), "w") as f:
                f.write(launcher(lab))
            changed["added"].append(f"labs/{lab.filename}")
        # what the grader needs: the labs, and each one's fingerprint as `make labs` generates it
        info = {"labs": labs, "stubs": {str(n): tree_digest(labgen.render(LABS[n], "labs", root)) for n in labs}}
        with open(os.path.join(out, "minizero_course", "grader", "handout.json"), "w") as f:
            json.dump(info, f, indent=1)
        changed["added"].append("minizero_course/grader/handout.json")
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # nothing half-written left behind
        raise
    return changed


def main(argv=None) -> int:
    from minizero.cli import checks
    ap = checks.Parser(prog="python -m minizero_course handout", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the folder to write (must not exist)")
    ap.add_argument("--labs", default=_all_labs(),
                    help=f"the labs the student writes, e.g. 1-6 or 1,3,8 (default: all, {_all_labs()})")
    args = ap.parse_args(argv)
    try:
        labs = parse_labs(args.labs)
    except ValueError as e:
        ap.error(str(e))
    if os.path.exists(args.out):
        ap.error(f"OUT {args.out!r} exists; give a new folder")
    parent = os.path.dirname(os.path.abspath(args.out))
    try:  # a folder made and removed, so nothing is left (os.access says yes to root everywhere)
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as e:
        ap.error(f"OUT {args.out!r}: cannot make a folder in {parent} ({e.strerror}): give a path in a folder you "
                 "can write")
    if not os.path.isdir(os.path.join(REPO, "solutions")):
        ap.error("this is a handout already (no solutions/): make a handout from the course's repository")
    changed = build(args.out, labs)
    for kind, paths in changed.items():
        shown = sorted({next((f for f in STAFF_ONLY if p.startswith(f)), p) for p in paths})  # a folder once
        print(f"{kind} ({len(paths)} files): {', '.join(shown)}")
    print(f"wrote {args.out}: labs {', '.join(map(str, labs))}; `cd {args.out} && make test`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
