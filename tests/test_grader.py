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
    # Fast because each stub raises NotImplementedError at its first call (asserted above: a stub
    # that hung until a timeout would say "timed out"); no wall-clock limit, the machine may be loaded.
    print(f"grading {n_checks} checks of untouched labs took {elapsed:.0f}s")


@pytest.mark.parametrize("lab", sorted(LABS))
def test_solutions_score_full_marks_in_gradescope_format(lab, graded):
    proc, result = graded(lab, "solutions")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = LABS[lab].checks()
    assert result["max_score"] == sum(c.max_score for c in checks if not c.extra)
    assert result["score"] == sum(c.max_score for c in checks)  # and every stretch task's extra points
    for t, c in zip(result["tests"], checks):
        assert set(t) >= {"name", "score", "max_score", "status", "output"}
        assert t["status"] == "passed" and t["score"] == c.max_score and t["max_score"] == (0 if c.extra else c.max_score)
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


def test_every_failure_becomes_that_checks_failing_entry(tmp_path):
    """A timeout, a rank dying in native code, a file that does not import and an error in the
    check's own code each become a failing entry with the reason and its likely cause."""
    from minizero import launch
    from minizero.autograde import Check, run_check
    lab = LABS[1]
    (tmp_path / lab.filename).write_text("import a_module_that_does_not_exist\n")

    def broken_check(impl):
        return {}["the check's own code breaks"]
    cases = {
        "timeout": (lambda impl: launch.run("tests/grader_workers.py:sleep_forever", nprocs=2, timeout=3),
                    ["timed out after 3s", "likely cause: a deadlock"]),
        "native crash": (lambda impl: launch.run("tests/grader_workers.py:die_in_native_code", nprocs=2, timeout=60),
                         ["rank 1 died without a Python traceback", "likely cause: a rank crashed in native code"]),
        "check error": (broken_check, ["the check could not run on this submission: KeyError"]),
        "import error": (next(c for c in lab.checks() if c.fn.__name__ == "check_bytes").fn,
                         ["ModuleNotFoundError", "likely cause: your lab file does not load"]),
    }
    for name, (fn, words) in cases.items():
        entry = run_check(lab, Check(name, 1, fn), str(tmp_path))
        assert entry["status"] == "failed" and entry["score"] == 0, (name, entry)
        for w in words:
            assert w in entry["output"], (name, w, entry["output"])


def test_results_json_is_written_even_if_grading_stops(tmp_path, monkeypatch):
    import minizero.autograde as autograde

    def stop(impl):
        raise KeyboardInterrupt  # not an Exception: nothing catches it, as a Ctrl-C or a killed check
    monkeypatch.setattr(autograde.Lab, "checks", lambda self: [autograde.Check("fine", 1, lambda impl: "ok"),
                                                              autograde.Check("stops", 1, stop)])
    out = tmp_path / "results.json"
    with pytest.raises(KeyboardInterrupt):
        autograde.main(["--lab", "1", "--impl", "solutions", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [t["name"] for t in result["tests"]] == ["lab 1: fine"] and result["score"] == result["max_score"] == 1


@pytest.mark.parametrize("raw,cause", [
    ("rank 1 failed: MPIDIG_recv_type_init(74): Message from rank 0 and tag 0 truncated; 40 bytes received but "
     "buffer size is 400", "chunk()"),
    ("rank 0 failed: ValueError: all_reduce on world: ranks disagree on shapes/dtypes: rank 0: [...]", "same order"),
    ("rank 0 failed: RuntimeError: The size of tensor a (5) must match the size of tensor b (4) at non-singleton "
     "dimension 0", "bucket.lo"),
    ("rank 2 failed: KeyError: \"transient.free('zero2.bucket3'): no live buffer of that name\"", "transient.alloc"),
    ("rank 0 failed: internal_Iallgather_c(279): Buffers must not be aliased", "send buffer"),
    ("rank 0 failed: ValueError: all_gather: output (12,) torch.float32 must hold 4 x input (4,)", "N times"),
    ("rank 1 failed: AttributeError: 'NoneType' object has no attribute 'wait'", "async_op=True"),
])
def test_raw_errors_get_their_likely_cause_under_them(raw, cause):
    from minizero.autograde.hints import with_hint
    text = with_hint(raw + "\n\ntraceback ...")
    head, hint, *_ = text.splitlines()
    assert head == raw and hint.startswith("likely cause: ") and cause in hint, text


def test_shared_launches_grade_like_single_ones(tmp_path, monkeypatch):
    """autograde.batch: the checks of 5 submissions, each launching twice, run in shared jobs;
    every entry is what the check says about ITS file, a submission that raises gets its own
    error (the ones before and after it keep their results), and the jobs number 3, not 10."""
    from minizero import launch
    from minizero.autograde import Check, CheckFailed
    from minizero.autograde.batch import run_checks
    texts = ["a", "b", "raise", "d", "e"]
    folders = []
    for i, text in enumerate(texts):
        (tmp_path / f"s{i}").mkdir()
        (tmp_path / f"s{i}" / LABS[1].filename).write_text(text)
        folders.append(str(tmp_path / f"s{i}"))

    def check(impl):
        first = launch.run("tests/grader_workers.py:echo", nprocs=2, args={"impl": impl}, timeout=60)
        again = launch.run("tests/grader_workers.py:echo", nprocs=2, args={"impl": impl, "again": True}, timeout=60)
        if first[0]["text"] == "b":
            raise CheckFailed("b is wrong")
        return f"{first[1]['text']} {again[0]['again']} {first[0]['ranks']}"
    jobs = []
    real = launch.run

    def counted(*args, **kwargs):
        jobs.append(kwargs.get("args", {}).get("calls"))
        return real(*args, **kwargs)
    monkeypatch.setattr(launch, "run", counted)
    lab, chk = LABS[1], Check("echo", 1, check)
    entries = run_checks([(lab, chk, f) for f in folders])
    assert [e["status"] for e in entries] == ["passed", "failed", "failed", "passed", "passed"]
    assert [e["output"] for e in entries[:2] + entries[3:]] == ["a True 2", "b is wrong", "d True 2", "e True 2"]
    assert "rank 1 raises for s2" in entries[2]["output"]
    # round 1: one job for the 5 first launches, ended by s2, then one for s3, s4; round 2: one job
    assert [len(c) for c in jobs] == [5, 2, 4], jobs
