"""Student-bug mutants for the grader's mutation suite.

Each `tests/mutants/labNN.py` holds `MUTANTS`, a list of `Mutant`s: one plausible student bug
each, written as a text patch on the generated solution `solutions/labNN_*.py`. The mutation
suite applies one mutant at a time to a copy of the solution, grades the copy on the one check
that must catch it, and asserts that the check fails with a message naming the cause.
A new lab ships with its mutants (at least 6)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str    # the student bug, in words ("divides by N twice")
    old: str     # text of solutions/labNN_*.py, found there exactly once
    new: str     # what the student wrote instead
    check: str   # the check that must fail: its function name in minizero_course/grader/labNN.py
    expect: str  # words the failure message must contain (case-insensitive): it names the cause
