"""The grader itself: untouched labs score zero (failing fast and clearly), results.json is
Gradescope's format, solutions score full marks, and bad input is an error."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minizero_course.grader import LABS, REPO
from minizero_course.grader import labgen

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

LABS_DIR = Path(REPO) / "labs"


def _grade(*args):
    return subprocess.run([sys.executable, "-m", "minizero_course", "grade", *args],
                          capture_output=True, text=True, timeout=600)


def _stubs_in(text: str) -> list[tuple[str, str]]:
    """(the def a stub raise sits in, its words), read from the generated file's text, not its tree."""
    return [(re.findall(r"def (\w+)\(", text[:m.start()])[-1], m.group(1))
            for m in re.finditer(r"raise NotImplementedError\(['\"]lab \d+: not implemented yet: (.*)['\"]\)", text)]


def test_untouched_labs_score_zero_without_a_launch(tmp_path, monkeypatch, capsys):
    """Every check of every untouched lab fails with 'not implemented yet', naming each function whose TODO
    is still a stub and the TODO's words, and no rank is launched for it (a launch costs seconds)."""
    from minizero import launch
    from minizero_course import grader
    launched = []

    def no_launch(target, *args, **kwargs):
        launched.append(target)
        raise RuntimeError(f"launched {target}")
    monkeypatch.setattr(launch, "run", no_launch)
    out = tmp_path / "results.json"
    assert grader.main(["--impl", "labs", "--json", str(out)]) == 1
    assert launched == [], f"untouched labs were launched: {launched} (is labs/ out of date? `make labs`)"
    result = json.loads(out.read_text())
    assert result["score"] == 0 and result["max_score"] > 0
    n_checks = sum(len(lab.checks()) for lab in LABS.values())
    assert len(result["tests"]) == n_checks
    for t in result["tests"]:
        n = int(t["name"].split(":")[0].split()[1])
        assert t["status"] == "failed" and t["score"] == 0
        assert t["output"].startswith(f"lab {n}: not implemented yet: "), t["output"]
        stubs = _stubs_in((LABS_DIR / LABS[n].filename).read_text())
        assert stubs, n
        for function, words in stubs:
            assert function in t["output"].splitlines()[0] and f"{function}: {words}" in t["output"], (function,
                                                                                                       t["output"])
    assert f"total: 0 / {result['max_score']:g}" in capsys.readouterr().out


def test_every_check_depends_on_the_students_file(graded):
    """The shortcut above scores an untouched lab 0 whatever its checks do, so this shows that each check would
    fail on the stubs on its own: a check that no mutant makes lose marks (tests/mutants: the others depend on
    the file by that suite) is launched on the lab with one line added outside its TODOs (started, so no
    shortcut), and fails on a stub it hits."""
    from tests.test_mutants import MUTANTS
    checks = [(n, c) for n, lab in LABS.items() for c in lab.checks()
              if c.fn.__name__ not in {m.check for m in MUTANTS.get(n, [])}]
    assert checks, "every check has a mutant: this test has nothing left to show"
    for n, check in checks:
        entry = graded.started_lab(n, check.fn.__name__)
        assert entry["status"] == "failed" and entry["score"] == 0, (n, check.name, entry)
        assert entry["output"].startswith(f"lab {n}: not implemented yet: "), (check.name, entry["output"])


def test_a_started_lab_is_launched_and_names_the_stub_its_ranks_hit(tmp_path, monkeypatch):
    """Only the untouched file skips its launch: lab 1 with a comment changed still does (a comment is no
    change), with one line added outside its TODOs it is graded by its ranks, and the first stub they hit
    is the message, as for a half-done lab."""
    from minizero import launch
    from minizero_course.grader import run_check, untouched_todos
    lab = LABS[1]
    check = next(c for c in lab.checks() if c.fn.__name__ == "check_bytes")
    text = (LABS_DIR / lab.filename).read_text()
    (tmp_path / lab.filename).write_text(text.replace("# TODO(lab 1): phase 1", "# my notes: phase 1"))
    assert untouched_todos(lab, str(tmp_path / lab.filename)) == _stubs_in(text)
    (tmp_path / lab.filename).write_text(text + "\nMY_HELPER = 1\n")
    assert untouched_todos(lab, str(tmp_path / lab.filename)) is None
    launched, real = [], launch.run
    monkeypatch.setattr(launch, "run", lambda target, *a, **k: launched.append(target) or real(target, *a, **k))
    entry = run_check(lab, check, str(tmp_path))
    assert launched == ["minizero_course.grader.lab01:bytes_worker"]
    assert entry["status"] == "failed" and entry["output"] == "lab 1: not implemented yet: phase 1, reduce-scatter"


@pytest.mark.parametrize("lab", sorted(LABS))
def test_solutions_score_full_marks_in_gradescope_format(lab, graded):
    result = graded(lab, "solutions")
    checks = LABS[lab].checks()
    assert result["max_score"] == sum(c.max_score for c in checks if not c.extra)
    assert result["score"] == sum(c.max_score for c in checks)  # and every stretch task's extra points
    assert len(result["tests"]) == len(checks)
    for t, c in zip(result["tests"], checks):
        assert set(t) >= {"name", "score", "max_score", "status", "output", "execution_time"}
        assert t["name"] == f"lab {lab}: {c.name}"
        assert t["status"] == "passed" and t["score"] == c.max_score and t["max_score"] == (0 if c.extra
                                                                                            else c.max_score), t


def test_the_grade_command_writes_results_json_and_prints_each_check(tmp_path):
    """The command a user runs, one lab as they run it (the other tests grade in shared launches): a line per
    check as it starts and as it ends, the total, results.json in Gradescope's format, exit 0 at full marks."""
    out = tmp_path / "results.json"
    proc = _grade("--lab", "14", "--impl", "solutions", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    checks = LABS[14].checks()
    assert [t["name"] for t in result["tests"]] == [f"lab 14: {c.name}" for c in checks]
    assert result["score"] == sum(c.max_score for c in checks)
    for c in checks:
        assert f"....  lab 14: {c.name}" in proc.stdout
        line = rf"PASS +{c.max_score:g}/(\d+|\+\d+ extra) +lab 14: {re.escape(c.name)}  \(\d+\.\ds\)"
        assert re.search(line, proc.stdout), (line, proc.stdout)
    assert f"total: {result['score']:g} / {result['max_score']:g}" in proc.stdout
    assert f"wrote {out}" in proc.stdout


def test_a_lab_scores_each_task_it_finished(tmp_path):
    """Lab 14 with its layout written and the block-sparse forward left as its stub: the layout's check
    scores its 3 points, and each check that needs the forward fails with the forward's own TODO (one
    unfinished task used to end the shared run and zero the lab)."""
    source = (Path(REPO) / "labs" / LABS[14].filename).read_text()
    stub = "raise NotImplementedError('lab 14: not implemented yet: the fixed layout of head h')"
    assert stub in source
    finished = source.replace(stub, "return _Fixed.head_layout(self, h, nb, generator)  # written")
    (tmp_path / LABS[14].filename).write_text(
        finished + "\nfrom minizero.sparse.layout import FixedSparsityConfig as _Fixed  # noqa: E402\n")
    out = tmp_path / "results.json"
    _grade("--lab", "14", "--impl", str(tmp_path), "--json", str(out))
    tests = {t["name"].removeprefix("lab 14: "): t for t in json.loads(out.read_text())["tests"]}
    layout, forward, cost = (tests[c.name] for c in LABS[14].checks()[:3])
    assert (layout["score"], layout["max_score"]) == (3, 3), layout
    for t in (forward, cost):
        assert t["score"] == 0 and t["output"].startswith("lab 14: not implemented yet: block-sparse forward"), t


@pytest.mark.parametrize("bug", ["one hop too many", "never waited"])
def test_a_bug_in_lab_11s_ring_loop_costs_only_the_checks_that_need_the_loop(bug, tmp_path):
    """Lab 11 with its ring loop wrong (one hop too many; the last step's transfer posted and never
    waited, which can crash the real ring): the ring-loop check fails with its own message,
    block_attention and merge keep their points (one run of every task, ended by the crash, zeroed
    all four)."""
    from minizero_course.grader.batch import run_checks
    from tests.mutants.lab11 import MUTANTS
    from tests.test_mutants import mutate
    mutate(LABS[11], next(m for m in MUTANTS if bug in m.name), tmp_path)
    checks = LABS[11].checks()
    block, merge, loop, ring = run_checks([(LABS[11], c, str(tmp_path)) for c in checks])
    assert block["score"] == checks[0].max_score, block
    assert merge["score"] == checks[1].max_score, merge
    assert loop["score"] == 0 and "cp - 1 hops bring every block" in loop["output"], loop
    if ring["score"] == 0:  # the real ring's fate, a crash or not, is the ring check's own
        assert "ring" in ring["name"] and ring["output"] != loop["output"], ring


def test_unknown_lab_lists_the_labs():
    proc = _grade("--lab", "99")
    assert proc.returncode != 0
    assert "unknown lab 99" in proc.stderr and "1 (Ring all-reduce" in proc.stderr


def test_labs_and_solutions_are_generated_from_one_source():
    assert labgen.main(["--check"]) == 0, "run `make labs`: labs/ or solutions/ differ from their source"


def test_stub_generation():
    src = ("def f():\n    x = 1\n    # BEGIN SOLUTION: add one. Then return.\n    x += 1\n    # END SOLUTION\n    "
           "return x\n")
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
    assert sol[2:6] == ["    # add one: the whole task.", "    #   first hint line", "    #   second hint line",
                        "    x += 1"]


def test_every_failure_becomes_that_checks_failing_entry(tmp_path, monkeypatch):
    """A timeout, a rank dying in native code, a file that does not import and an error in the
    check's own code each become a failing entry with the reason and its likely cause."""
    monkeypatch.setenv("MINIZERO_TIMEOUT_SCALE", "1")  # the 3 s timeout below is what is checked
    from minizero import launch
    from minizero_course.grader import Check, run_check
    lab = LABS[1]
    (tmp_path / lab.filename).write_text("import a_module_that_does_not_exist\n")

    def broken_check(impl):
        return {}["the check's own code breaks"]
    cases = {
        "timeout": (lambda impl: launch.run("tests/grader_workers.py:sleep_forever", nprocs=2, timeout=3),
                    ["timed out after 3s", "likely cause: no rank was waiting in a collective"]),  # every rank sleeps
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


@pytest.mark.parametrize("worker,said,unsaid", [
    ("recv_first", ["a point-to-point deadlock: ranks 0, 1", "matching send",
                    "rank 0: blocked in recv from rank 1 (8 B)",
                    "rank 1: blocked in recv from rank 0"],
     ["collective", "n2"]),
    ("skip_the_all_reduce", ["a deadlock in collectives: rank 0 ", "rank 1: running its own code",
                             "rank 0: blocked in the collective all_reduce"],
     ["point-to-point", "recv", "n2"]),
])
def test_a_deadlock_says_which_kind_of_operation_hung_and_where(worker, said, unsaid, monkeypatch):
    """A timeout's entry says whether the ranks hung in point-to-point messages or in a collective,
    which operation on which rank, with no communicator's name (the grader's sub-group n2)."""
    monkeypatch.setenv("MINIZERO_TIMEOUT_SCALE", "load")  # the ranks start, then hang: a deadlock
    from minizero import launch
    from minizero_course.grader import Check, run_check

    def hangs(impl):
        return launch.run(f"tests/grader_workers.py:{worker}", nprocs=2, timeout=8)
    output = run_check(LABS[1], Check(worker, 1, hangs), "solutions")["output"]
    assert re.match(r"timed out after [\d.]+s: ", output), output
    for words in said:
        assert words in output, (words, output)
    for words in unsaid:
        assert words not in output, (words, output)


def test_a_timeout_names_every_rank_by_its_rank_in_the_job():
    """A peer in a sub-group is named by its rank in the job (the heartbeat's '(job rank J)'), as the
    report's lines name the ranks; the groups' names (tp, dp) are left out."""
    from minizero_course.grader.hints import timeout_message
    text = timeout_message(9, {2: "in recv from rank 0 of tp (job rank 3) (8 B)",
                               3: "in all_reduce (4 B) on dp"})
    assert text.startswith("timed out after 9s: a deadlock: some ranks waited in a send or recv, "
                           "others in a collective"), text
    assert "rank 2: blocked in recv from rank 3 (8 B): waiting for a message rank 3 never sent" in text
    assert "rank 3: blocked in the collective all_reduce (4 B)" in text
    assert " of tp" not in text and " on dp" not in text, text


def test_results_json_is_written_even_if_grading_stops(tmp_path, monkeypatch):
    import minizero_course.grader as grader

    def stop(impl):
        raise KeyboardInterrupt  # not an Exception: nothing catches it, as a Ctrl-C or a killed check
    monkeypatch.setattr(grader.Lab, "checks", lambda self: [grader.Check("fine", 1, lambda impl: "ok"),
                                                              grader.Check("stops", 1, stop)])
    out = tmp_path / "results.json"
    with pytest.raises(KeyboardInterrupt):
        grader.main(["--lab", "1", "--impl", "solutions", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [t["name"] for t in result["tests"]] == ["lab 1: fine"] and result["score"] == result["max_score"] == 1


@pytest.mark.parametrize("main_ok", [False, True])
def test_stretch_points_count_only_when_the_main_checks_are_full(tmp_path, monkeypatch, capsys, main_ok):
    """A 2-point main check failed and a 2-point stretch task passed: the stretch entry scores 0 and says why,
    the total stays below full marks and grade exits 1. With the main check passed, the extra points count."""
    import minizero_course.grader as grader

    def main_check(impl):
        if not main_ok:
            raise grader.CheckFailed("the gather was blocking")
        return "ok"
    monkeypatch.setattr(grader.Lab, "checks", lambda self: [
        grader.Check("main", 2, main_check), grader.Check("other", 3, lambda impl: "ok"),
        grader.Check("stretch", 2, lambda impl: "ok", extra=True)])
    out = tmp_path / "results.json"
    code = grader.main(["--lab", "8", "--impl", "solutions", "--json", str(out)])
    result = json.loads(out.read_text())
    stretch = result["tests"][2]
    assert result["max_score"] == 5 and stretch["max_score"] == 0 and stretch["status"] == "passed"
    out = capsys.readouterr().out
    assert out.index("....  lab 8: main\n") < out.index(" lab 8: main  (")  # a line as each check starts
    if main_ok:
        assert code == 0 and result["score"] == 7 and stretch["score"] == 2
    else:
        assert code == 1 and result["score"] == 3 and stretch["score"] == 0
        assert stretch["output"].startswith("passed, but its 2 extra points count only when every main check of "
                                            "lab 8 is full (failed: main)")
        assert "count only when every main check" in out


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
    from minizero_course.grader.hints import with_hint
    text = with_hint(raw + "\n\ntraceback ...")
    head, hint, *_ = text.splitlines()
    assert head == raw and hint.startswith("likely cause: ") and cause in hint, text


def test_shared_launches_grade_like_single_ones(tmp_path, monkeypatch):
    """grader.batch: the checks of 5 submissions, each launching twice, run in shared jobs;
    every entry is what the check says about ITS file, a submission that raises gets its own
    error (the ones before and after it keep their results), and the jobs number 3, not 10."""
    from minizero import launch
    from minizero_course.grader import Check, CheckFailed
    from minizero_course.grader.batch import run_checks
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


def test_a_deadlock_in_a_shared_job_costs_one_deadline(tmp_path, monkeypatch):
    """A lab-1 ring that receives from the wrong neighbour hangs in its first recv. Graded in one
    shared job with the solution's two checks (each launch given the same short timeout, the
    deadline under test), it costs its own deadline, not the job's sum of timeouts and then a second
    run alone; its entry names each rank and the receive it was blocked in, and the calls after it
    keep their results."""
    import time

    from minizero import launch
    from minizero_course.grader import Check
    from minizero_course.grader.batch import run_checks
    from tests.mutants.lab01 import DEADLOCKS
    from tests.test_mutants import mutate
    monkeypatch.setenv("MINIZERO_TIMEOUT_SCALE", "load")  # start-up and deadline grow with the load
    timeout = 20.0

    def short(check):  # the lab's own check, its launch given `timeout`
        def fn(impl):
            recorder = launch.run  # run_checks' recorder while the check runs
            launch.run = lambda target, **kw: recorder(target, **{**kw, "timeout": timeout})
            try:
                return check.fn(impl)
            finally:
                launch.run = recorder
        return Check(check.name, check.max_score, fn)
    lab = LABS[1]
    checks = {c.fn.__name__: short(c) for c in lab.checks()}
    mutate(lab, DEADLOCKS[0], tmp_path)
    jobs = [(lab, checks["check_equals_allreduce"], str(tmp_path))] + [(lab, c, "solutions")
                                                                       for c in checks.values()]
    start = time.perf_counter()
    hung, *solution = run_checks(jobs)
    elapsed = time.perf_counter() - start
    assert [e["status"] for e in solution] == ["passed", "passed"], [e["output"] for e in solution]
    said = re.search(r"timed out after ([\d.]+)s", hung["output"])
    assert hung["status"] == "failed" and said, hung["output"]
    deadline = float(said.group(1))  # the timeout times the load per core (1 to 20) as it ran
    assert timeout <= deadline <= 20 * timeout, deadline
    assert re.search(r"rank 0\b.*recv from rank 1", hung["output"]), hung["output"]
    # one deadline and two jobs' start-up (the hung one, the one after it; a job's start-up is a few
    # seconds times the load): not the job's sum of timeouts (3 deadlines), then the hung call alone
    assert deadline < elapsed < 2 * deadline, (elapsed, deadline)
