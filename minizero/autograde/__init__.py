"""The autograder: lab registry, checks, score table and Gradescope results.json.

Each lab N has a module `minizero.autograde.labNN` (found by name: adding a lab touches no
shared file) with
  * `LAB = Lab(number, name, title, source)`: `source` is the minizero module whose
    BEGIN/END SOLUTION regions become the lab's TODOs (see minizero.cli.labgen);
  * `CHECKS`: a list of `Check(name, max_score, fn)`; `fn(impl_file) -> str` returns what it
    measured, or raises `CheckFailed` saying what was wrong. A stretch task's check has
    `extra=True`: its points are extra credit (Gradescope: max_score 0, the points as score when
    it passes), so full marks never need it;
  * `demo(comm, impl)`: what `mpirun -n 4 python labs/labNN_*.py` prints for the student.
Checks run the student's code on several ranks through `minizero.launch`, so a stub, a
crash or a deadlock becomes a failed check with a clear message, never a hung grader.
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
import time
from dataclasses import dataclass
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Lab:
    number: int
    name: str           # file stem after labNN_
    title: str
    source: str | tuple  # the marked reference module(s) labs/ and solutions/ are generated from, joined in order
    nprocs: int = 4

    @property
    def filename(self):
        return f"lab{self.number:02d}_{self.name}.py"

    def checks(self):
        return importlib.import_module(f"minizero.autograde.lab{self.number:02d}").CHECKS


def _discover() -> dict[int, Lab]:
    labs = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("lab") and info.name[3:].isdigit():
            lab = importlib.import_module(f"{__name__}.{info.name}").LAB
            labs[lab.number] = lab
    return dict(sorted(labs.items()))


LABS: dict[int, Lab] = {}  # filled at the bottom of this module


class CheckFailed(AssertionError):
    """A check ran and measured something wrong; the message says what."""


@dataclass(frozen=True)
class Check:
    name: str
    max_score: float
    fn: Callable[[str], str]
    extra: bool = False  # a stretch task: extra credit, not part of the lab's max_score


_LAUNCHES: dict = {}


def launched_once(target: str, nprocs: int, args: dict, timeout: float) -> list:
    """One launch of `target` per (target, ranks, args), shared by the checks that read it: the per-rank
    results, or the same LaunchError again for every check (a stub or a crash fails them all alike, at once)."""
    from minizero import launch
    key = (target, nprocs, repr(sorted(args.items())))
    if key not in _LAUNCHES:
        try:
            _LAUNCHES[key] = launch.run(target, nprocs=nprocs, args=args, timeout=timeout)
        except launch.LaunchError as e:
            _LAUNCHES[key] = e
    if isinstance(_LAUNCHES[key], Exception):
        raise _LAUNCHES[key]
    return _LAUNCHES[key]


def judged_check(judge, measured, *args):
    """A check that grades a file by judging a shared run: judge(measured(impl, *args)), named check_x after
    judge_x (the mutation suite and results.json show that name)."""
    def check(impl):
        return judge(measured(impl, *args))
    check.__name__ = judge.__name__.replace("judge_", "check_")
    return check


def first_phase(results, phase: str) -> list:
    """The phase's result on each rank; an error in it (on any rank) fails the check with that error."""
    for rank, r in enumerate(results):
        if "error" in r[phase]:
            raise CheckFailed(f"rank {rank}: {r[phase]['error']}")
    return [r[phase] for r in results]


def get_lab(number: int) -> Lab:
    if number not in LABS:
        raise SystemExit(f"unknown lab {number}; the labs are: "
                         + ", ".join(f"{n} ({lab.title})" for n, lab in sorted(LABS.items())))
    return LABS[number]


def impl_file(lab: Lab, impl: str) -> str:
    """`impl` is 'labs', 'solutions' or a folder holding labNN_*.py (a student's submission)."""
    folder = impl if os.path.isabs(impl) else os.path.join(REPO, impl) if impl in ("labs", "solutions") else os.path.abspath(impl)
    path = os.path.join(folder, lab.filename)
    if not os.path.exists(path):
        raise CheckFailed(f"lab {lab.number}: {path} not found")
    return path


_STUB_TREES: dict = {}


def untouched_todos(lab: Lab, path: str) -> list | None:
    """[(function, the TODO's words), ...] in file order if the file at `path` is the lab exactly as
    `make labs` generates it (every TODO still its stub; comments and blank lines may differ: the two
    syntax trees are compared), else None. Read, never imported: nothing of the student's file runs here.

    Such a file fails every check on its first stub (the grader's tests hold labs/ to that), so
    run_check scores it 0 without launching ranks; a lab with any change is launched as always."""
    import ast

    from minizero.cli import labgen
    if lab.number not in _STUB_TREES:
        _STUB_TREES[lab.number] = ast.dump(ast.parse(labgen.render(lab, "labs")))
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None  # a file that does not parse is graded as always: its ranks report the error
    if ast.dump(tree) != _STUB_TREES[lab.number]:
        return None
    prefix = f"lab {lab.number}: not implemented yet: "
    stubs = []

    def visit(node, names):
        for child in ast.iter_child_nodes(node):
            inner = names + [child.name] if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else names
            if (isinstance(child, ast.Raise) and isinstance(child.exc, ast.Call) and child.exc.args
                    and getattr(child.exc.func, "id", None) == "NotImplementedError"
                    and isinstance(child.exc.args[0], ast.Constant) and str(child.exc.args[0].value).startswith(prefix)):
                stubs.append((".".join(names) or "<module>", child.exc.args[0].value[len(prefix):]))
            visit(child, inner)
    visit(tree, [])
    return stubs


def _untouched_message(lab: Lab, stubs: list) -> str:
    functions = list(dict.fromkeys(name for name, _ in stubs))
    return (f"lab {lab.number}: not implemented yet: {', '.join(functions)} (every TODO in {lab.filename} is still "
            f"its stub; no rank was launched)\n" + "\n".join(f"  {name}: {words}" for name, words in stubs))


def run_check(lab: Lab, check: Check, impl: str) -> dict:
    """Run one check; always returns a Gradescope test entry, never raises for a broken submission.

    Whatever goes wrong (the check's verdict, a rank's exception, a native crash, a timeout, a
    file that does not import, an error in the check itself) becomes this check's failing entry
    with its reason, and a known raw error gets its likely cause under it (autograde.hints)."""
    import traceback

    from minizero import launch
    from minizero.autograde.hints import with_hint
    t0 = time.time()
    try:
        path = impl_file(lab, impl)
        stubs = untouched_todos(lab, path)
        if stubs:
            raise CheckFailed(_untouched_message(lab, stubs))
        output, ok = check.fn(path), True
    except CheckFailed as e:
        output, ok = str(e), False
    except launch.RankError as e:
        if e.last_line.startswith("NotImplementedError") and f"lab {lab.number}" in e.last_line:
            output = e.last_line.split(": ", 1)[1]  # the stub's own "lab N: not implemented yet: ..."
        else:
            output = with_hint(f"{e.args[0].splitlines()[0]}\n\n{e.rank_traceback[-3000:]}")
        ok = False
    except launch.LaunchError as e:  # a timeout, a rank that died in native code, mpirun failing
        output, ok = with_hint(str(e)[-4000:]), False
    except Exception as e:  # noqa: BLE001 - e.g. the student's file breaks the check's own code
        output = with_hint(f"the check could not run on this submission: {type(e).__name__}: {e}\n\n"
                           f"{traceback.format_exc()[-3000:]}")
        ok = False
    return {"name": f"lab {lab.number}: {check.name}",
            "score": check.max_score if ok else 0.0,
            "max_score": 0.0 if check.extra else check.max_score, "status": "passed" if ok else "failed",
            "output": output, "execution_time": round(time.time() - t0, 2)}


def grade(labs: list[int], impl: str, progress=print, tests: list | None = None) -> dict:
    """Grade every check of `labs`; entries are appended to `tests` as they finish (main writes
    them to results.json even if grading is interrupted)."""
    tests = [] if tests is None else tests
    for n in labs:
        lab = get_lab(n)
        for check in lab.checks():
            entry = run_check(lab, check, impl)
            points = f"+{check.max_score:g} extra" if check.extra else f"{entry['max_score']:g}"
            progress(f"{'PASS' if entry['status'] == 'passed' else 'FAIL'}  {entry['score']:>4g}/{points:<4} "
                     f"{entry['name']}  ({entry['execution_time']:.1f}s)")
            if entry["status"] != "passed":
                for line in entry["output"].splitlines()[:2]:  # the message, and its likely cause if known
                    if line.strip():
                        progress("      " + line[:300])
            tests.append(entry)
    return _result(tests)


def _result(tests: list) -> dict:
    return {"score": sum(t["score"] for t in tests), "max_score": sum(t["max_score"] for t in tests),
            "tests": tests}


def main(argv=None) -> int:
    from minizero.cli import checks
    ap = checks.Parser(prog="minizero grade", description="Grade labs; writes a Gradescope results.json.")
    ap.add_argument("--lab", type=int, action="append", metavar="N", help="lab number (repeatable); default: all")
    ap.add_argument("--impl", default="labs", help="'labs' (default), 'solutions', or a folder with labNN_*.py files")
    ap.add_argument("--json", metavar="FILE", help="write Gradescope results.json here")
    args = ap.parse_args(argv)
    labs = args.lab or sorted(LABS)
    for n in labs:
        if n not in LABS:
            ap.error(f"--lab {n}: unknown lab {n}; the labs are: "
                     + ", ".join(f"{k} ({lab.title})" for k, lab in LABS.items()))
    if args.impl not in ("labs", "solutions") and not os.path.isdir(args.impl):
        ap.error(f"--impl {args.impl}: no such folder (give 'labs', 'solutions' or a folder with labNN_*.py files)")
    checks.output_file(ap, "--json", args.json)  # before grading: a result that cannot be written is lost
    tests: list = []
    try:
        grade(labs, args.impl, tests=tests)
    finally:  # results.json is written whatever happens, with every check graded so far
        result = _result(tests)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    print(f"\ntotal: {result['score']:g} / {result['max_score']:g}")
    if args.json:
        print(f"wrote {args.json}")
    return 0 if result["score"] >= result["max_score"] else 1  # stretch tasks' extra credit may exceed it


def print_losses(label_a: str, losses_a, label_b: str, losses_b, digits: int = 5):
    """A lab demo's loss table: step, then two runs' losses side by side."""
    print(f"{'step':>4} {label_a:>{digits + 8}} {label_b:>{digits + 8}}")
    for step, (a, b) in enumerate(zip(losses_a, losses_b)):
        print(f"{step:>4} {a:>{digits + 8}.{digits}f} {b:>{digits + 8}.{digits}f}")


def lab_main(number: int, namespace: dict):
    """`mpirun -n 4 python labs/labNN_*.py`: run the lab's demo with the file's own functions. A stub
    (NotImplementedError) or a crash is said once for the job, and the job ends; a collective that
    makes no progress for MINIZERO_WATCHDOG_S seconds (default 300) ends it too, naming the rank."""
    import traceback
    from types import SimpleNamespace

    from minizero import comm as comm_mod
    from minizero.comm import watchdog
    lab = get_lab(number)
    where = namespace.get("__file__", f"labs/{lab.filename}")
    try:
        comm = comm_mod.init()
    except RuntimeError as e:
        sys.exit(f"lab {number}: {e}")
    watchdog.start(comm)
    if comm.size == 1:
        print(f"lab {number} on 1 rank: start it with `mpirun -n {lab.nprocs} python {where}` to run {lab.nprocs} ranks",
              file=sys.stderr)
    module = importlib.import_module(f"minizero.autograde.lab{number:02d}")
    try:
        module.demo(comm, SimpleNamespace(**namespace))
    except NotImplementedError as e:
        watchdog.end_job(comm, f"\n{e}\nFill in the TODO regions of {where}, then run again.", 2)
    except ValueError as e:
        if comm.size == lab.nprocs:  # at the lab's own size a ValueError is the code's: its traceback below
            watchdog.end_job(comm, f"lab {number}: rank {comm.rank} failed:\n{traceback.format_exc()}", 1)
        # another world size that the demo's layout refuses (lab 10's vocabulary of 64 over 3 ranks): the input
        watchdog.end_job(comm, f"lab {number} on {comm.size} rank{'s' * (comm.size != 1)}: {e}. The demo runs on {lab.nprocs}: "
                               f"`mpirun -n {lab.nprocs} python {where}`", 2)
    except Exception:  # noqa: BLE001  the student's bug: one traceback, from the rank that failed first
        watchdog.end_job(comm, f"lab {number}: rank {comm.rank} failed:\n{traceback.format_exc()}", 1)


LABS.update(_discover())
