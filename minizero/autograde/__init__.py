"""The autograder: lab registry, checks, score table and Gradescope results.json.

Each lab N has a module `minizero.autograde.labNN` (found by name: adding a lab touches no
shared file) with
  * `LAB = Lab(number, name, title, source)`: `source` is the minizero module whose
    BEGIN/END SOLUTION regions become the lab's TODOs (see minizero.cli.labgen);
  * `CHECKS`: a list of `Check(name, max_score, fn)`; `fn(impl_file) -> str` returns what it
    measured, or raises `CheckFailed` saying what was wrong;
  * `demo(comm, impl)`: what `mpirun -n 4 python labs/labNN_*.py` prints for the student.
Checks run the student's code on several ranks through `minizero.launch`, so a stub, a
crash or a deadlock becomes a failed check with a clear message, never a hung grader.
"""
from __future__ import annotations

import argparse
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
    source: str         # the marked reference module labs/ and solutions/ are generated from
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


def run_check(lab: Lab, check: Check, impl: str) -> dict:
    """Run one check; always returns a Gradescope test entry, never raises for student errors."""
    from minizero import launch
    t0 = time.time()
    try:
        output, ok = check.fn(impl_file(lab, impl)), True
    except CheckFailed as e:
        output, ok = str(e), False
    except launch.RankError as e:
        if e.last_line.startswith("NotImplementedError") and f"lab {lab.number}" in e.last_line:
            output = e.last_line.split(": ", 1)[1]  # the stub's own "lab N: not implemented yet: ..."
        else:
            output = f"{e.args[0].splitlines()[0]}\n\n{e.rank_traceback[-3000:]}"
        ok = False
    except launch.LaunchTimeout as e:
        output, ok = str(e), False
    return {"name": f"lab {lab.number}: {check.name}", "score": check.max_score if ok else 0.0,
            "max_score": check.max_score, "status": "passed" if ok else "failed",
            "output": output, "execution_time": round(time.time() - t0, 2)}


def grade(labs: list[int], impl: str, progress=print) -> dict:
    tests = []
    for n in labs:
        lab = get_lab(n)
        for check in lab.checks():
            entry = run_check(lab, check, impl)
            progress(f"{'PASS' if entry['status'] == 'passed' else 'FAIL'}  {entry['score']:>4g}/{entry['max_score']:<4g} "
                     f"{entry['name']}  ({entry['execution_time']:.1f}s)")
            if entry["status"] != "passed":
                progress("      " + entry["output"].splitlines()[0][:300])
            tests.append(entry)
    return {"score": sum(t["score"] for t in tests), "max_score": sum(t["max_score"] for t in tests),
            "tests": tests}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="minizero grade", description="Grade labs; writes a Gradescope results.json.")
    ap.add_argument("--lab", type=int, action="append", help="lab number (repeatable); default: all")
    ap.add_argument("--impl", default="labs", help="'labs' (default), 'solutions', or a folder with labNN_*.py files")
    ap.add_argument("--json", metavar="FILE", help="write Gradescope results.json here")
    args = ap.parse_args(argv)
    labs = args.lab or sorted(LABS)
    for n in labs:
        get_lab(n)
    result = grade(labs, args.impl)
    print(f"\ntotal: {result['score']:g} / {result['max_score']:g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if result["score"] == result["max_score"] else 1


def lab_main(number: int, namespace: dict):
    """`mpirun -n 4 python labs/labNN_*.py`: run the lab's demo with the file's own functions."""
    from types import SimpleNamespace
    from minizero import comm as comm_mod
    comm = comm_mod.init()
    module = importlib.import_module(f"minizero.autograde.lab{number:02d}")
    try:
        module.demo(comm, SimpleNamespace(**namespace))
    except NotImplementedError as e:
        if comm.rank == 0:
            print(f"\n{e}\nFill in the TODO regions of {namespace.get('__file__', 'the lab file')}, then run again.",
                  file=sys.stderr)
            sys.stderr.flush()
        else:
            time.sleep(1.0)  # let rank 0 print its message before the abort ends everyone
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(2)  # the other ranks may be waiting in a collective


LABS.update(_discover())
