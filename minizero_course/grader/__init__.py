"""The autograder: lab registry, checks, score table and Gradescope results.json.

Each lab N has a module `minizero_course.grader.labNN` (found by name: adding a lab touches no
shared file) with
  * `LAB = Lab(number, name, title, source)`: `source` is the minizero module whose
    BEGIN/END SOLUTION regions become the lab's TODOs (see minizero_course.grader.labgen);
  * `CHECKS`: a list of `Check(name, max_score, fn)`; `fn(impl_file) -> str` returns what it
    measured, or raises `CheckFailed` saying what was wrong. A stretch task's check has
    `extra=True`: its points are extra credit (Gradescope: max_score 0, the points as score when
    it passes), so full marks never need it, and they count only once every main check of the lab
    is full (`stretch_policy`);
  * `demo(comm, impl)`: what `mpirun -n 4 python labs/labNN_*.py` prints for the student.
Checks run the student's code on several ranks through `minizero.launch`, so a stub, a
crash or a deadlock becomes a failed check with a clear message, never a hung grader.
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Written by `python -m minizero_course handout` into a student's copy: its labs, and each untouched lab's fingerprint
# (that copy has no marked source to render the stubs from). None in the course's own repository.
HANDOUT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "handout.json")
HANDOUT = json.load(open(HANDOUT_FILE)) if os.path.exists(HANDOUT_FILE) else None
DEFAULT_IMPL = "package" if HANDOUT else "labs"


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
        return importlib.import_module(f"minizero_course.grader.lab{self.number:02d}").CHECKS


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
            todo = re.search(r"NotImplementedError: (lab \d+: not implemented yet: .*)", r[phase]["error"])
            raise CheckFailed(todo.group(1) if todo else f"rank {rank}: {r[phase]['error']}")
    return [r[phase] for r in results]


def get_lab(number: int) -> Lab:
    if number not in LABS:
        raise SystemExit(f"unknown lab {number}; the labs are: "
                         + ", ".join(f"{n} ({lab.title})" for n, lab in sorted(LABS.items())))
    return LABS[number]


def impl_file(lab: Lab, impl: str) -> str:
    """`impl` is 'labs', 'solutions', 'package' (the lab's modules in the package itself: a handout's) or a
    folder holding labNN_*.py (a student's submission). The package's modules are joined into one lab file
    in build/grade/ (labgen.render), which the checks load as they load labs/ files."""
    if impl == "package":
        from minizero_course.grader import labgen
        path = os.path.join(REPO, "build", "grade", lab.filename)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(labgen.render(lab, "package"))
        return path
    folder = (impl if os.path.isabs(impl) else os.path.join(REPO, impl) if impl in ("labs", "solutions")
              else os.path.abspath(impl))
    path = os.path.join(folder, lab.filename)
    if not os.path.exists(path):
        raise CheckFailed(f"lab {lab.number}: {path} not found")
    return path


_STUB_TREES: dict = {}


def tree_digest(text: str) -> str:
    """sha256 of a file's syntax tree: equal for two files that differ only in comments and blank lines."""
    import ast
    import hashlib
    return hashlib.sha256(ast.dump(ast.parse(text)).encode()).hexdigest()


def stub_digest(lab: Lab) -> str:
    """tree_digest of the lab as `make labs` generates it (a handout keeps it in handout.json)."""
    if lab.number not in _STUB_TREES:
        if HANDOUT:
            _STUB_TREES[lab.number] = HANDOUT["stubs"].get(str(lab.number))
        else:
            from minizero_course.grader import labgen
            _STUB_TREES[lab.number] = tree_digest(labgen.render(lab, "labs"))
    return _STUB_TREES[lab.number]


def untouched_todos(lab: Lab, path: str) -> list | None:
    """[(function, the TODO's words), ...] in file order if the file at `path` is the lab exactly as
    `make labs` generates it (every TODO still its stub; comments and blank lines may differ: the two
    syntax trees are compared), else None. Read, never imported: nothing of the student's file runs here.

    Such a file fails every check on its first stub (the grader's tests hold labs/ to that), so
    run_check scores it 0 without launching ranks; a lab with any change is launched as always."""
    import ast
    try:
        with open(path) as f:
            text = f.read()
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return None  # a file that does not parse is graded as always: its ranks report the error
    if tree_digest(text) != stub_digest(lab):
        return None
    prefix = f"lab {lab.number}: not implemented yet: "
    stubs = []

    def visit(node, names):
        for child in ast.iter_child_nodes(node):
            inner = (names + [child.name] if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     else names)
            if (isinstance(child, ast.Raise) and isinstance(child.exc, ast.Call) and child.exc.args
                    and getattr(child.exc.func, "id", None) == "NotImplementedError"
                    and isinstance(child.exc.args[0], ast.Constant)
                    and str(child.exc.args[0].value).startswith(prefix)):
                stubs.append((".".join(names) or "<module>", child.exc.args[0].value[len(prefix):]))
            visit(child, inner)
    visit(tree, [])
    return stubs


def _untouched_message(lab: Lab, stubs: list, impl: str) -> str:
    """Names the file(s) the student edits: a handout's package modules, else the lab file."""
    from minizero_course.grader import labgen
    functions = list(dict.fromkeys(name for name, _ in stubs))
    where = " and ".join(labgen.sources(lab)) if impl == "package" else lab.filename
    return (f"lab {lab.number}: not implemented yet: {', '.join(functions)} "
            f"(every TODO in {where} is still its stub; no rank was launched)\n"
            + "\n".join(f"  {name}: {words}" for name, words in stubs))


def run_check(lab: Lab, check: Check, impl: str) -> dict:
    """Run one check; always returns a Gradescope test entry, never raises for a broken submission.

    Whatever goes wrong (the check's verdict, a rank's exception, a native crash, a timeout, a
    file that does not import, an error in the check itself) becomes this check's failing entry
    with its reason, and a known raw error gets its likely cause under it (grader.hints)."""
    import traceback

    from minizero import launch
    from minizero_course.grader.hints import timeout_message, with_hint
    t0 = time.time()
    try:
        path = impl_file(lab, impl)
        stubs = untouched_todos(lab, path)
        if stubs:
            raise CheckFailed(_untouched_message(lab, stubs, impl))
        output, ok = check.fn(path), True
    except CheckFailed as e:
        output, ok = str(e), False
    except launch.RankError as e:
        if e.last_line.startswith("NotImplementedError") and f"lab {lab.number}" in e.last_line:
            output = e.last_line.split(": ", 1)[1]  # the stub's own "lab N: not implemented yet: ..."
        else:
            output = with_hint(f"{e.args[0].splitlines()[0]}\n\n{e.rank_traceback[-3000:]}")
        ok = False
    except launch.LaunchTimeout as e:  # which rank was blocked in what, in the student's words
        output, ok = timeout_message(e.timeout, e.where), False
    except launch.LaunchError as e:  # a rank that died in native code, mpirun failing
        output, ok = with_hint(str(e)[-4000:]), False
    except Exception as e:  # noqa: BLE001 - e.g. the student's file breaks the check's own code
        output = with_hint(f"the check could not run on this submission: {type(e).__name__}: {e}\n\n"
                           f"{traceback.format_exc()[-3000:]}")
        ok = False
    return {"name": f"lab {lab.number}: {check.name}",
            "score": check.max_score if ok else 0.0,
            "max_score": 0.0 if check.extra else check.max_score, "status": "passed" if ok else "failed",
            "output": output, "execution_time": round(time.time() - t0, 2)}


def grade(labs: list[int], impl: str, progress=print, tests: list | None = None, on_entry=None) -> dict:
    """Grade every check of `labs`; entries are appended to `tests` as they finish, and on_entry(tests) is
    called after each (main writes results.json then: a grader killed from outside leaves what it graded).
    A line says which check starts, and one how it ended: a multi-rank check takes seconds to minutes."""
    tests = [] if tests is None else tests
    for n in labs:
        lab = get_lab(n)
        checks, entries = lab.checks(), []
        for check in checks:
            progress(f"....  lab {n}: {check.name}")
            entry = run_check(lab, check, impl)
            points = f"+{check.max_score:g} extra" if check.extra else f"{entry['max_score']:g}"
            progress(f"{'PASS' if entry['status'] == 'passed' else 'FAIL'}  {entry['score']:>4g}/{points:<4} "
                     f"{entry['name']}  ({entry['execution_time']:.1f}s)")
            if entry["status"] != "passed":
                for line in entry["output"].splitlines()[:2]:  # the message, and its likely cause if known
                    if line.strip():
                        progress("      " + line[:300])
            tests.append(entry)
            entries.append(entry)
            if on_entry:
                on_entry(tests)
        for entry in stretch_policy(lab, checks, entries):
            progress(f"      {entry['name']}: {entry['output'].splitlines()[0]}")
    return _result(tests)


def stretch_policy(lab: Lab, checks: list, entries: list) -> list:
    """A stretch task's points count only when every main check of its lab is full: extra credit adds to a
    finished lab, it never makes up for a missing part of it. The passed stretch entries of a lab with a
    failed main check get score 0 and say why (changed in place; returned)."""
    failed = [c.name for c, e in zip(checks, entries) if not c.extra and e["score"] < c.max_score]
    withheld = []
    for check, entry in zip(checks, entries):
        if check.extra and failed and entry["score"] > 0:
            entry["score"] = 0.0
            entry["output"] = (f"passed, but its {check.max_score:g} extra points count only when every main check of "
                               f"lab {lab.number} is full (failed: {'; '.join(failed)})\n\n{entry['output']}")
            withheld.append(entry)
    return withheld


def _result(tests: list) -> dict:
    return {"score": sum(t["score"] for t in tests), "max_score": sum(t["max_score"] for t in tests),
            "tests": tests}


def main(argv=None) -> int:
    from minizero.cli import checks
    ap = checks.Parser(prog="minizero_course grade", description="Grade labs; writes a Gradescope results.json.")
    ap.add_argument("--lab", type=int, action="append", metavar="N", help="lab number (repeatable); default: all")
    ap.add_argument("--impl", default=DEFAULT_IMPL,
                    help=f"'labs', 'solutions', 'package' (the lab's modules in minizero/ itself, as in a handout) "
                         f"or a folder with labNN_*.py files; default: {DEFAULT_IMPL}")
    ap.add_argument("--json", metavar="FILE", help="write Gradescope results.json here")
    args = ap.parse_args(argv)
    labs = args.lab or (HANDOUT["labs"] if HANDOUT else sorted(LABS))
    for n in labs:
        if n not in LABS:
            ap.error(f"--lab {n}: unknown lab {n}; the labs are: "
                     + ", ".join(f"{k} ({lab.title})" for k, lab in LABS.items()))
        if HANDOUT and n not in HANDOUT["labs"]:
            ap.error(f"--lab {n}: this handout's labs are {', '.join(map(str, HANDOUT['labs']))} "
                     f"(lab {n}'s code is in the package as written)")
    if HANDOUT and args.impl in ("labs", "solutions"):  # a handout's labs/ holds demos only
        ap.error(f"--impl {args.impl}: in this handout your code is graded where you write it, in "
                 "minizero/ (--impl package, the default: python -m minizero_course grade --lab N); labs/ "
                 "holds each lab's demo")
    if args.impl not in ("labs", "solutions", "package") and not os.path.isdir(args.impl):
        ap.error(f"--impl {args.impl}: no such folder (give 'labs', 'solutions', 'package' or a folder with "
                 "labNN_*.py files)")
    if os.path.isdir(args.impl) and args.impl not in ("labs", "solutions") and not any(
            os.path.exists(os.path.join(args.impl, LABS[n].filename)) for n in labs):
        ap.error(f"--impl {args.impl}: holds none of the files graded here ("
                 + ", ".join(LABS[n].filename for n in labs[:3]) + (", ..." if len(labs) > 3 else "") + ")")
    checks.output_file(ap, "--json", args.json)  # before grading: a result that cannot be written is lost
    tests: list = []

    def write(tests):
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(_result(tests), f, indent=2)
            os.replace(args.json + ".tmp", args.json)
    try:
        grade(labs, args.impl, tests=tests, on_entry=write)
    finally:  # results.json is written whatever happens, with every check graded so far
        result = _result(tests)
        write(tests)
    print(f"\ntotal: {result['score']:g} / {result['max_score']:g}")
    if args.json:
        print(f"wrote {args.json}")
    main_full = all(t["score"] >= t["max_score"] for t in result["tests"])  # a stretch entry's max_score is 0
    return 0 if main_full else 1


def print_losses(label_a: str, losses_a, label_b: str, losses_b, digits: int = 5):
    """A lab demo's loss table: step, then two runs' losses side by side."""
    print(f"{'step':>4} {label_a:>{digits + 8}} {label_b:>{digits + 8}}")
    for step, (a, b) in enumerate(zip(losses_a, losses_b)):
        print(f"{step:>4} {a:>{digits + 8}.{digits}f} {b:>{digits + 8}.{digits}f}")


def package_namespace(number: int, launcher: str) -> dict:
    """The names of lab `number`'s modules as the package has them, a later module's over an earlier one's
    (as in the joined lab file): a handout's labs/labNN_*.py (`launcher`) runs the lab's demo on them."""
    from minizero_course.grader import labgen
    names: dict = {}
    for path in labgen.sources(get_lab(number)):
        names.update(vars(importlib.import_module(path.removesuffix(".py").replace("/", "."))))
    return {**names, "__file__": launcher}


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
        print(f"lab {number} on 1 rank: start it with `mpirun -n {lab.nprocs} python {where}` to run "
              f"{lab.nprocs} ranks", file=sys.stderr)
    module = importlib.import_module(f"minizero_course.grader.lab{number:02d}")
    try:
        module.demo(comm, SimpleNamespace(**namespace))
    except NotImplementedError as e:
        watchdog.end_job(comm, f"\n{e}\nFill in the TODO regions of {where}, then run again.", 2)
    except ValueError as e:
        if comm.size == lab.nprocs:  # at the lab's own size a ValueError is the code's: its traceback below
            watchdog.end_job(comm, f"lab {number}: rank {comm.rank} failed:\n{traceback.format_exc()}", 1)
        # another world size that the demo's layout refuses (lab 10's vocabulary of 64 over 3 ranks): the input
        watchdog.end_job(comm,
                         f"lab {number} on {comm.size} rank{'s' * (comm.size != 1)}: {e}. The demo runs on "
                         f"{lab.nprocs}: "
                               f"`mpirun -n {lab.nprocs} python {where}`", 2)
    except Exception:  # noqa: BLE001  the student's bug: one traceback, from the rank that failed first
        watchdog.end_job(comm, f"lab {number}: rank {comm.rank} failed:\n{traceback.format_exc()}", 1)


LABS.update(_discover())
