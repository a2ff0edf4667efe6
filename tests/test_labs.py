"""Each lab check as a pytest test, tagged per lab: `pytest -m lab1 --impl labs` grades your lab 1.

By default (and in CI) the checks grade solutions/, which must score full marks."""
import pytest

from minizero_course.grader import LABS

CASES = [pytest.param(n, check, id=f"lab{n}-{check.fn.__name__}", marks=getattr(pytest.mark, f"lab{n}"))
         for n, lab in sorted(LABS.items()) for check in lab.checks()]


@pytest.mark.parametrize("lab,check", CASES)
def test_lab_check(lab, check, impl, graded):
    result = graded(lab, impl)
    entry = next(t for t in result["tests"] if t["name"] == f"lab {lab}: {check.name}")
    assert entry["status"] == "passed", entry["output"]
    # a stretch task (extra=True) is extra credit: its points come with max_score 0 (Gradescope)
    assert entry["score"] == check.max_score > 0 and entry["max_score"] == (0 if check.extra else check.max_score)
