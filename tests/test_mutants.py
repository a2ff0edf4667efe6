"""The grader's mutation suite: every plausible student bug must lose marks, for the right reason.

Each `tests/mutants/labNN.py` lists `Mutant`s (tests/mutants/__init__.py): a text patch on the
generated solution, the check that must catch it and words its message must contain. For each
one, the solution is copied to a temporary folder and the patch applied; the copy is graded on
that ONE check, by the grader's own `run_check`, in this process (no grade process per mutant),
with every other grading of the session in shared launches (tests/shared_grading.py: start-up is
paid per rank count and round, not per mutant). The checks launch their ranks through
minizero.launch as always, so no collective runs in pytest. A lab added later is picked up by
its file name (tests/mutants/labNN.py), and must bring at least MIN_PER_LAB mutants.
"""
import importlib
import os
from pathlib import Path

import pytest

from minizero_course.grader import LABS, REPO

MUTANT_DIR = Path(__file__).resolve().parent / "mutants"
MIN_PER_LAB = 6
MIN_FROM_LAB_7 = 8  # labs 07 on: at least 8 plausible bugs each, a stretch task's own mutants on top


def load_mutants() -> dict:
    """{lab number: [Mutant, ...]} from every tests/mutants/labNN.py."""
    return {int(path.stem[3:]): importlib.import_module(f"tests.mutants.{path.stem}").MUTANTS
            for path in sorted(MUTANT_DIR.glob("lab[0-9]*.py"))}


MUTANTS = load_mutants()
# Marked `mutants` only, not `labN`: `pytest -m lab2 --impl labs` grades a student's lab, not these.
CASES = [pytest.param(n, m, id=f"lab{n}-{k}-{m.check}", marks=pytest.mark.mutants)
         for n, mutants in MUTANTS.items() if n in LABS for k, m in enumerate(mutants)]


# A main check's bug in a lab with a stretch task, where the stretch points would make up for the check's.
POLICY_CASES = [pytest.param(n, m, id=f"lab{n}-{k}-{m.check}", marks=pytest.mark.mutants)
                for n, mutants in MUTANTS.items() if n in LABS for k, m in enumerate(mutants)
                if (extra := sum(c.max_score for c in LABS[n].checks() if c.extra))
                and not (c := {c.fn.__name__: c for c in LABS[n].checks()}[m.check]).extra and c.max_score <= extra]


def mutate(lab, mutant, folder: Path) -> Path:
    """Write the solution of `lab` with `mutant`'s patch applied into `folder`."""
    source = (Path(REPO) / "solutions" / lab.filename).read_text()
    found = source.count(mutant.old)
    if found != 1:
        raise AssertionError(f"lab {lab.number} mutant '{mutant.name}': its old text occurs {found} times in "
                             f"solutions/{lab.filename}, must be exactly once (did the solution change?)")
    path = folder / lab.filename
    path.write_text(source.replace(mutant.old, mutant.new))
    return path


def the_check(number: int, mutant):
    return {c.fn.__name__: c for c in LABS[number].checks()}[mutant.check]


@pytest.fixture(scope="module")
def graded_mutants(graded):
    """graded_mutants(number, mutant) -> the mutant's entry on its check, graded with every other grading of
    this session in shared launches (tests/shared_grading.py)."""
    yield graded.mutant
    if os.environ.get("MINIZERO_MUTANT_TABLE"):  # e.g. for the note: every mutant's score and message
        Path(os.environ["MINIZERO_MUTANT_TABLE"]).write_text(graded.table())


def test_every_lab_has_its_mutants(tmp_path):
    """Cheap and static, so a stale mutant fails here first: each lab has >= MIN_PER_LAB mutants,
    each names a real check and patches text found exactly once in the solution."""
    assert set(MUTANTS) <= set(LABS), f"mutant files for labs that do not exist: {sorted(set(MUTANTS) - set(LABS))}"
    for n, lab in LABS.items():
        mutants = MUTANTS.get(n, [])
        least = MIN_FROM_LAB_7 if n >= 7 else MIN_PER_LAB
        extra = {c.fn.__name__ for c in lab.checks() if c.extra}
        main = [m for m in mutants if m.check not in extra]
        assert len(main) >= least, (f"lab {n} has {len(main)} mutants of its main checks in "
                                    f"tests/mutants/lab{n:02d}.py; it needs at least {least} plausible student bugs")
        for name in extra:
            assert any(m.check == name for m in mutants), f"lab {n}: the stretch task's check {name} has no mutant"
        checks = {c.fn.__name__ for c in lab.checks()}
        for m in mutants:
            assert m.check in checks, f"lab {n} mutant '{m.name}': no check {m.check!r} (the checks: {sorted(checks)})"
            assert m.old != m.new and m.expect.strip(), f"lab {n} mutant '{m.name}' changes nothing or expects nothing"
            mutate(lab, m, tmp_path)


@pytest.mark.parametrize("number,mutant", CASES)
def test_mutant_loses_marks(number, mutant, graded_mutants):
    check, entry = the_check(number, mutant), graded_mutants(number, mutant)
    assert entry["score"] < check.max_score, (
        f"lab {number} mutant '{mutant.name}' scored full marks on '{check.name}':\n{entry['output']}")
    assert mutant.expect.lower() in entry["output"].lower(), (
        f"lab {number} mutant '{mutant.name}' failed '{check.name}', but the message does not name the cause "
        f"(expected {mutant.expect!r} in it):\n{entry['output']}")


@pytest.mark.parametrize("number,mutant", POLICY_CASES)
def test_stretch_points_never_make_up_for_a_failed_main_check(number, mutant, graded_mutants):
    """The mutant's own failing entry, every other check of its lab at full marks (the best a student with
    this bug can reach) and the stretch task passed: the lab stays below full marks and grade exits 1."""
    from minizero_course.grader import _result, stretch_policy
    checks = LABS[number].checks()
    entry = graded_mutants(number, mutant)
    entries = [dict(entry) if c.fn.__name__ == mutant.check else
               {"name": f"lab {number}: {c.name}", "score": c.max_score, "max_score": 0.0 if c.extra else c.max_score,
                "status": "passed", "output": "ok"} for c in checks]
    stretch_policy(LABS[number], checks, entries)
    result = _result(entries)
    assert result["score"] < result["max_score"], (mutant.name, result)
    assert all(e["score"] == 0 for c, e in zip(checks, entries) if c.extra)
    assert any("count only when every main check" in e["output"] for c, e in zip(checks, entries) if c.extra)
