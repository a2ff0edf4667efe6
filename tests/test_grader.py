"""The grader itself: untouched labs score zero (failing fast and clearly), results.json is
Gradescope's format, solutions score full marks, and bad input is an error."""
import json
import subprocess
import sys
import time

import pytest

from minizero.cli import labgen
from minizero.autograde import LABS


def _grade(*args):
    return subprocess.run([sys.executable, "-m", "minizero", "grade", *args],
                          capture_output=True, text=True, timeout=600)


def test_untouched_labs_score_zero_fast(tmp_path):
    out = tmp_path / "results.json"
    t0 = time.time()
    proc = _grade("--impl", "labs", "--json", str(out))
    elapsed = time.time() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["score"] == 0 and result["max_score"] > 0
    n_checks = sum(len(lab.checks()) for lab in LABS.values())
    assert len(result["tests"]) == n_checks
    for t in result["tests"]:
        assert t["status"] == "failed" and t["score"] == 0
        assert t["output"].startswith(f"lab {t['name'].split(':')[0].split()[1]}: not implemented yet"), t["output"]
    assert elapsed < 15 * n_checks, f"grading stubs took {elapsed:.0f}s: checks must fail fast"


@pytest.mark.parametrize("lab", sorted(LABS))
def test_solutions_score_full_marks_in_gradescope_format(lab, graded):
    proc, result = graded(lab, "solutions")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["score"] == result["max_score"] == sum(c.max_score for c in LABS[lab].checks())
    for t in result["tests"]:
        assert set(t) >= {"name", "score", "max_score", "status", "output"}
        assert t["status"] == "passed" and t["score"] == t["max_score"]
    assert f"total: {result['score']:g} / {result['max_score']:g}" in proc.stdout


def test_unknown_lab_lists_the_labs():
    proc = _grade("--lab", "99")
    assert proc.returncode != 0
    assert "unknown lab 99" in proc.stderr and "1 (Ring all-reduce" in proc.stderr


def test_labs_and_solutions_are_generated_from_one_source():
    assert labgen.main(["--check"]) == 0, "run `make labs`: labs/ or solutions/ differ from their source"


def test_stub_generation():
    src = "def f():\n    x = 1\n    # BEGIN SOLUTION: add one. Then return.\n    x += 1\n    # END SOLUTION\n    return x\n"
    lab = labgen.transform(src, 7, stub=True)
    assert "x += 1" not in lab and "raise NotImplementedError('lab 7: not implemented yet: add one')" in lab
    assert "# TODO(lab 7): add one. Then return." in lab
    sol = labgen.transform(src, 7, stub=False)
    assert "x += 1" in sol and "BEGIN" not in sol
    with pytest.raises(ValueError, match="unterminated"):
        labgen.transform("# BEGIN SOLUTION\nx\n", 1, stub=True)


def test_stub_generation_multiline_hint():
    src = ("def f():\n    x = 1\n    # BEGIN SOLUTION: add one: the whole task.\n    #   first hint line\n"
           "    #   second hint line\n    x += 1\n    # END SOLUTION\n    return x\n")
    lab = labgen.transform(src, 7, stub=True).splitlines()
    todo = lab.index("    # TODO(lab 7): add one: the whole task.")
    assert lab[todo + 1:todo + 4] == ["    #   first hint line", "    #   second hint line",
                                      "    raise NotImplementedError('lab 7: not implemented yet: add one')"]
    assert "    x += 1" not in lab
    sol = labgen.transform(src, 7, stub=False).splitlines()
    assert sol[2:6] == ["    # add one: the whole task.", "    #   first hint line", "    #   second hint line", "    x += 1"]
