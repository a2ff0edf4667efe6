"""`python -m minizero_course gradescope`: the bundle's run_autograder, run in a simulated Gradescope
layout (ROOT/source unzipped from the bundle, ROOT/submission, ROOT/results/results.json), grades
lab 1: the solution full marks, the untouched stub zero, a crashing or hanging submission its
failing entries, and results.json always."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from minizero.zygote import SOCKET_VAR
from minizero_course.grader import LABS, REPO, labgen

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

LAB = LABS[1]
MAX = sum(c.max_score for c in LAB.checks() if not c.extra)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The bundle of lab 1, unzipped as Gradescope does into source/."""
    tmp = tmp_path_factory.mktemp("gradescope")
    proc = subprocess.run([sys.executable, "-m", "minizero_course", "gradescope", str(tmp / "lab01.zip"), "--lab", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with zipfile.ZipFile(tmp / "lab01.zip") as z:
        names = z.namelist()
        z.extractall(tmp / "source")
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
    assert {"setup.sh", "run_autograder", "minizero_course/grader/handout.json"} <= set(names)
    assert not any(n.startswith(("solutions/", "tests/mutants/")) for n in names)
    assert modes["run_autograder"] & 0o111 and modes["setup.sh"] & 0o111
    return tmp / "source"


def autograde(source: Path, root: Path, files: dict, limit_s: float = 300) -> tuple[dict, subprocess.CompletedProcess]:
    """Run the bundle's run_autograder on a submission of `files` ({relative path: text}) under `root`."""
    (root / "source").symlink_to(source)
    for rel, text in files.items():
        (root / "submission" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "submission" / rel).write_text(text)
    (root / "submission").mkdir(exist_ok=True)
    # as in Gradescope's container: no PYTHONPATH and no zygote of a parent to fork ranks from (the
    # grader's processes, its ranks too, carry MINIZERO_GRADESCOPE_ROOT: the leftover check below)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", SOCKET_VAR)}
    env.update(MINIZERO_GRADESCOPE_ROOT=str(root), MINIZERO_GRADESCOPE_PYTHON=sys.executable,
               MINIZERO_GRADESCOPE_LIMIT_S=str(limit_s))
    proc = subprocess.run(["bash", str(source / "run_autograder")], env=env, capture_output=True, text=True,
                          timeout=limit_s + 120)
    results = root / "results" / "results.json"
    assert results.exists(), f"no results.json:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(results.read_text()), proc


def solution(path: str) -> str:
    return labgen.transform((Path(REPO) / path).read_text(), 1, stub=False)


def test_the_solution_scores_full_marks(source, tmp_path):
    """The solved module where a handout student wrote it (their repository's path)."""
    result, proc = autograde(source, tmp_path, {"my-repo/minizero/comm/ring.py": solution("minizero/comm/ring.py")})
    assert result["score"] == result["max_score"] == MAX, proc.stdout[-3000:]
    assert [t["status"] for t in result["tests"]] == ["passed"] * len(LAB.checks())
    assert "graded my-repo/minizero/comm/ring.py" in result["output"]
    assert result["visibility"] == result["stdout_visibility"] == "visible"  # else hidden until published


def test_the_untouched_lab_scores_zero(source, tmp_path):
    result, _ = autograde(source, tmp_path, {"ring.py": (source / "minizero/comm/ring.py").read_text()})
    assert result["score"] == 0 and result["max_score"] == MAX and len(result["tests"]) == len(LAB.checks())
    assert all("no rank was launched" in t["output"] for t in result["tests"])


def test_a_crashing_submission_gets_its_failing_entries(source, tmp_path):
    """A lab file (the course repository's labs/ workflow) whose ring dies in native code on every rank."""
    text = (Path(REPO) / "solutions" / LAB.filename).read_text()
    doc = '    """Sum `tensor` over all ranks of `comm`, in place, using only isend/recv."""\n'
    crash = text.replace(doc, doc + "    import ctypes; ctypes.string_at(0)  # a segfault\n")
    assert crash.count("ctypes.string_at(0)") == 1
    result, _ = autograde(source, tmp_path, {f"labs/{LAB.filename}": crash})
    assert result["score"] == 0 and len(result["tests"]) == len(LAB.checks())
    for t in result["tests"]:
        assert t["status"] == "failed" and "died" in t["output"], t["output"]


def test_a_hanging_submission_is_stopped_and_results_json_written(source, tmp_path):
    hang = solution("minizero/comm/ring.py").replace(
        "def ring_all_reduce(comm, tensor", "def _ring(comm, tensor") + \
        "\n\ndef ring_all_reduce(comm, tensor, *args, **kwargs):\n    import time\n    time.sleep(3600)\n"
    result, _ = autograde(source, tmp_path, {"minizero/comm/ring.py": hang}, limit_s=12)
    assert result["score"] == 0 and len(result["tests"]) == len(LAB.checks())
    assert any("time limit of 12 s" in t["output"] for t in result["tests"]), result
    assert result["execution_time"] < 12 + 60
    # nothing the stopped grader started is left running (its ranks run in a job session of their own)
    # (every process run_autograder starts inherits this test's own MINIZERO_GRADESCOPE_ROOT)
    mark = f"MINIZERO_GRADESCOPE_ROOT={tmp_path}".encode()
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _environ_has(pid, mark)]
    assert not left, f"processes of the stopped grader still running: {left}"


def _environ_has(pid: str, item: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return item in f.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def test_an_empty_submission_says_which_files(source, tmp_path):
    result, _ = autograde(source, tmp_path, {})
    assert result["score"] == 0 and len(result["tests"]) == len(LAB.checks())
    assert all("neither lab01_ring_allreduce.py nor minizero/comm/ring.py" in t["output"] for t in result["tests"])


def test_bad_input_is_one_message(tmp_path):
    for args, words in [([str(tmp_path / "x.zip"), "--lab", "99"], "--lab 99"),
                        ([str(tmp_path / "x.tar")], "give a .zip")]:
        proc = subprocess.run([sys.executable, "-m", "minizero_course", "gradescope", *args], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())
