"""minizero's environment variables, read and checked in this one place.

Every MINIZERO_* variable a user may set is listed in VARIABLES with what it allows. `get(name)` returns
its value (the default when unset) or raises EnvError naming the variable, the value and what is allowed;
`check()` does that for every variable that is set. The commands (train, bench, grade, demo) and comm.init
call `check_or_exit` before anything starts, so a typo is one line and exit code 2, said by launched rank 0
only, instead of a traceback from every rank at its first use.

The variables launch.run sets for its own jobs (MINIZERO_JOB_ID, MINIZERO_SCALE_PROBE) are markers, not
settings, and the test suite's (MINIZERO_SITE, MINIZERO_MUTANT_TABLE) are read by the tests: neither is here.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable


class EnvError(ValueError):
    """A MINIZERO_* variable holds a value minizero cannot use; the message names it and what is allowed."""


@dataclass(frozen=True)
class Variable:
    parse: Callable[[str], Any]  # text -> value; raises ValueError when the text is not allowed
    default: Any                 # the value when the variable is unset
    allowed: str                 # what may be set, in words (the error says it)
    means: str                   # what it does (docs/environment.md lists these)


def _seconds(zero_ok: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)  # ValueError for 'abc'
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise ValueError(text)
        return value
    return parse


def _choice(*names: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in names:
            raise ValueError(text)
        return text
    return parse


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(text)
    return text == "1"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _directory(text: str) -> str:
    if not os.path.isdir(text) or not os.access(text, os.W_OK | os.X_OK):
        raise ValueError(text)
    return text


VARIABLES: dict[str, Variable] = {
    "MINIZERO_BACKEND": Variable(
        _choice("mpi", "torch"), None, "mpi or torch (torch picks NCCL on CUDA and gloo on CPU by itself)",
        "the communicator's library; unset: mpi on CPU under mpirun, torch otherwise"),
    "MINIZERO_DEBUG": Variable(
        _flag, False, "0 or 1",
        "1: every collective first compares its shapes and dtypes across ranks (one small all-gather each)"),
    "MINIZERO_WATCHDOG_S": Variable(
        _seconds(zero_ok=True), 300.0, "seconds, a number >= 0 (0 turns the watchdog off)",
        "a rank blocked this long in one collective ends the job, naming every rank's place (default 300)"),
    "MINIZERO_INIT_TIMEOUT_S": Variable(
        _seconds(zero_ok=False), 60.0, "seconds, a number > 0",
        "how long the torch.distributed rendezvous waits for every rank, and `minizero torchrun`'s for every agent "
        "(default 60)"),
    "MINIZERO_HEARTBEAT_DIR": Variable(
        _directory, None, "an existing directory this process can write to",
        "where the ranks' heartbeat files go (launch.run sets it; across machines: a shared directory)"),
    "MINIZERO_MAX_RANKS": Variable(
        _positive_int, 8, "a whole number >= 1",
        "the most ranks launch.run starts on this machine (default 8: 2 cores oversubscribed further are flaky)"),
    "MINIZERO_MPI_STAGE": Variable(
        _flag, False, "0 or 1",
        "1: the mpi backend stages CPU tensors through a host copy too, as it always does CUDA ones (several ranks "
        "on one GPU); make test-gpu's --quick run takes that path on CPU"),
    "MINIZERO_GRADESCOPE_ROOT": Variable(
        _directory, "/autograder", "an existing directory this process can write to",
        "the Gradescope autograder's folder (source/, submission/, results/); tests simulate it in a temporary one"),
    "MINIZERO_GRADESCOPE_LIMIT_S": Variable(
        _seconds(zero_ok=False), 540.0, "seconds, a number > 0",
        "the Gradescope autograder stops grading after this long and writes results.json (default 540)"),
    "MINIZERO_MULTINODE": Variable(
        _flag, False, "0 or 1",
        "1: under mpirun, rank 0 announces its hostname's address for torch.distributed, not 127.0.0.1"),
}


def get(name: str, environ=None):
    """The variable's value (its default when unset); EnvError when it is set to something not allowed.
    environ: the environment to read (default os.environ; launch.run checks its ranks' before starting them)."""
    var = VARIABLES[name]
    text = (os.environ if environ is None else environ).get(name)
    if text is None:
        return var.default
    try:
        return var.parse(text)
    except ValueError:
        raise EnvError(f"environment variable {name}={text!r} is not allowed: use {var.allowed} "
                       f"(or unset it). {name}: {var.means}") from None


def is_set(name: str) -> bool:
    """Whether the variable is in the environment at all (MINIZERO_HEARTBEAT_DIR set: launch.run's job)."""
    assert name in VARIABLES, name
    return name in os.environ


def check(environ=None) -> dict:
    """Every set variable's value; EnvError for the first one that is not allowed."""
    environ = os.environ if environ is None else environ
    return {name: get(name, environ) for name in VARIABLES if name in environ}


def check_or_exit(prog: str = "minizero"):
    """check(), and on a bad variable: launched rank 0 prints the one line, every rank exits with code 2
    (before any rank has met another: nothing to end, nothing written)."""
    try:
        check()
    except EnvError as e:
        from minizero.comm.launcher import launched_rank
        if launched_rank() == 0:
            sys.stderr.write(f"{prog}: {e}\n")
            sys.stderr.flush()
        raise SystemExit(2) from None
