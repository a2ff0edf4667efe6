"""tests/progress.py, the per-file progress lines of `make test`, on a tiny fake suite in a
subprocess (the plugin as `make test` loads it: `-p tests.progress`, with -q)."""
import json
import os
import re
import subprocess
import sys

from tests.progress import NO_ESTIMATE
import pytest

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"^(tests/test_\w+\.py): (\d+) tests?, ([\d.]+) s, load ([\d.]+) ([\d.]+) "
                  r"([\d.]+) \((\d+) cores\) \| (\d+) of (\d+) files, (.*)$")
SKIPPED = "import pytest\n\n\n@pytest.mark.skip(reason='x')\ndef test_skipped():\n    pass\n"


def _suite(tmp_path, earlier=None, committed=None):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text("def test_one():\n    pass\n\n\ndef test_two():\n    pass\n")
    (tests / "test_b.py").write_text(SKIPPED)
    (tests / "test_c.py").write_text("def test_fails():\n    assert 1 == 2\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    if earlier is not None:
        (tmp_path / "build").mkdir()
        (tmp_path / "build" / "test-times.json").write_text(json.dumps({"file_s": earlier}))
    if committed is not None:  # a fresh clone's: the committed times of an idle run
        (tests / "test-times.json").write_text(json.dumps({"file_s": committed}))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.progress", "-p", "no:cacheprovider",
           "tests"]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=120)
    return proc, [LINE.match(x) for x in proc.stdout.splitlines() if LINE.match(x)]


def test_a_line_per_file_with_its_tests_seconds_load_and_place_and_the_summary_intact(tmp_path):
    proc, lines = _suite(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # test_c fails: the run's verdict stays
    assert [(m[1], int(m[2]), int(m[8]), int(m[9])) for m in lines] == [
        ("tests/test_a.py", 2, 1, 3), ("tests/test_b.py", 1, 2, 3), ("tests/test_c.py", 1, 3, 3)
    ], proc.stdout
    assert all(float(m[3]) < 30 and int(m[7]) == os.cpu_count() for m in lines), proc.stdout
    assert lines[0][10] == NO_ESTIMATE
    last = proc.stdout.strip().splitlines()[-1]  # -q's closing line, which CI reads, unchanged
    assert re.fullmatch(r"1 failed, 2 passed, 1 skipped in [\d.]+s", last), last
    assert "FAILED tests/test_c.py::test_fails" in proc.stdout


def test_the_time_left_is_the_last_runs_seconds_for_the_files_to_come(tmp_path):
    # The last run: test_a took 2 s (under the 5 s needed to compare paces: this run's pace counts
    # as 1), test_b 60 s; test_c is new: its one test at that run's mean, (2 + 60) / 3 tests. Once
    # test_b is done, this run has taken ~0 s for what took that run 62 s: at that pace nothing is
    # left.
    earlier = {"tests/test_a.py": 2.0, "tests/test_b.py": 60.0, "tests/gone.py": 5}
    proc, lines = _suite(tmp_path, earlier=earlier)
    left = [m[10] for m in lines]
    want = [f"about {60 + 62 / 3:.0f} s left", "about 0 s left", "about 0 s left"]
    assert left == want, proc.stdout


def test_a_fresh_clone_estimates_from_the_committed_times(tmp_path):
    committed = {"tests/test_a.py": 2.0, "tests/test_b.py": 30.0, "tests/test_c.py": 10.0}
    proc, lines = _suite(tmp_path, committed=committed)
    assert lines[0][10] == "about 40 s left", proc.stdout  # test_a's 2 s are under the 5 s pace floor
    with open(os.path.join(ROOT, "tests", "test-times.json")) as f:  # the one this repository ships
        shipped = json.load(f)
    suite = {f"tests/{n}" for n in os.listdir(os.path.join(ROOT, "tests")) if n.startswith("test_")}
    assert set(shipped["file_s"]) <= suite, sorted(set(shipped["file_s"]) - suite)  # no stale name
    assert sum(shipped["file_s"].values()) > 600, shipped["file_s"]  # a whole run, not a few files


def test_make_test_loads_the_plugin_with_q():
    """`make test`'s pytest line (CI runs it: .ci/run) keeps -q, whose closing line CI reads, and
    loads the plugin."""
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    line = re.search(r"^test:.*\n\t(.*)$", makefile, re.M)[1]
    assert "-m pytest -q " in line and "-p tests.progress" in line, line
