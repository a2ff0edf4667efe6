"""`python -m minizero_course handout`: the student's copy holds no solution, grades the student's package (zero
untouched, full marks with the solutions pasted back), and its `make test` passes.

One handout of every lab is built per module (file copies: seconds); the graded runs happen inside it, with
PYTHONPATH at the handout, as a student's would."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from minizero_course.grader import LABS, REPO, labgen, tree_digest
from minizero_course.kit import handout

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`


def in_handout(root: Path, *args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    root = tmp_path_factory.mktemp("handout") / "student"
    proc = subprocess.run([sys.executable, "-m", "minizero_course", "handout", str(root)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return root


def test_the_handout_holds_no_solution_text(student):
    """No file holds a line of any region's code, no package module a SOLUTION marker, and each region of
    the package is its stub (the TODO and its NotImplementedError) where the lessons import it."""
    assert not (student / "solutions").exists() and not (student / "tests" / "mutants").exists()
    lines = {line: n for n, found in labgen.solution_lines().items() for line in found}
    assert len(lines) > 50  # the scan has something to look for
    for path in student.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            shown = [f"lab {n}: {line}" for line, n in lines.items() if line in text]
            assert not shown, f"{path.relative_to(student)} shows solution text: {shown[:3]}"
    for n, lab in LABS.items():
        for source in labgen.sources(lab):
            text = (student / source).read_text()
            regions = len(labgen.regions((Path(REPO) / source).read_text()))
            assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text, source
            assert text.count(f"raise NotImplementedError('lab {n}: not implemented yet: ") + text.count(
                f'raise NotImplementedError("lab {n}: not implemented yet: ') == regions, source


def test_the_untouched_handout_scores_zero(student):
    """Its grader grades its package: every check of every lab fails as not implemented, at once (no launch)."""
    proc = in_handout(student, sys.executable, "-m", "minizero_course", "grade", "--json", "results.json")
    result = json.loads((student / "results.json").read_text())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert result["score"] == 0 and result["max_score"] == sum(c.max_score for lab in LABS.values()
                                                               for c in lab.checks() if not c.extra)
    assert len(result["tests"]) == sum(len(lab.checks()) for lab in LABS.values())
    for t in result["tests"]:
        assert (t["status"] == "failed" and "not implemented yet" in t["output"]
                and "no rank was launched" in t["output"]), t
        lab = LABS[int(t["name"].split(":")[0].split()[1])]  # named: where its TODO is here
        assert f"every TODO in {' and '.join(labgen.sources(lab))} is still" in t["output"], t
    wrong = in_handout(student, sys.executable, "-m", "minizero_course", "grade", "--lab", "1",
                       "--impl", "labs")
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, wrong.stderr
    assert "--impl package" in wrong.stderr, wrong.stderr


def test_the_handout_with_the_solutions_pasted_back_scores_full_marks(student, tmp_path):
    """Each region's code pasted back in place of its stub: the file the grader makes from the package is the
    solution's (tests/test_grader.py grades solutions/ to full marks), and lab 1, graded end to end in the
    handout, gets full marks; its launcher runs the demo on the package."""
    import shutil
    pasted = tmp_path / "pasted"
    shutil.copytree(student, pasted)
    for n, lab in LABS.items():
        for source in labgen.sources(lab):
            (pasted / source).write_text(labgen.transform((Path(REPO) / source).read_text(), n, stub=False))
        assert tree_digest(labgen.render(lab, "package", str(pasted))) == tree_digest(
            (Path(REPO) / "solutions" / lab.filename).read_text()), lab.filename
    proc = in_handout(pasted, sys.executable, "-m", "minizero_course", "grade", "--lab", "1", "--json", "results.json")
    result = json.loads((pasted / "results.json").read_text())
    assert proc.returncode == 0 and result["score"] == result["max_score"] == 10, proc.stdout + proc.stderr
    demo = in_handout(pasted, "mpirun", "-n", "4", sys.executable, "labs/lab01_ring_allreduce.py", timeout=120)
    assert demo.returncode == 0 and "ring all-reduce of 4.2 MB on 4 ranks" in demo.stdout, demo.stdout + demo.stderr


def test_the_handouts_make_test_passes(student):
    """The recipe of its Makefile's `test` target (run here without `setup`: the venv is this one)."""
    recipe = re.search(r"^test:.*\n\t\$\(PY\) -m (pytest .*)$", (student / "Makefile").read_text(), re.MULTILINE)
    assert recipe, "the handout's Makefile has no `test` recipe"
    proc = in_handout(student, sys.executable, "-m", *shlex.split(recipe.group(1)), "-p", "no:cacheprovider")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.search(r"\d+ passed", proc.stdout) and "failed" not in proc.stdout


def test_lessons_name_the_students_files(student):
    """The lessons' exercises say where to write a lab: in the handout, its module(s), not labs/
    (which holds the demos there); no lesson asks for --impl labs."""
    for path in sorted((student / "lessons").glob("*.ipynb")):
        text = path.read_text()
        for lab in LABS.values():
            old = f"labs/{lab.filename}"
            assert f"in `{old}`" not in text and f"`{old}` (" not in text, path.name
        assert "--impl labs" not in text, path.name
    assert "in `minizero/dp/ddp.py`" in (student / "lessons" / "02_dp_ddp.ipynb").read_text()


def test_lessons_that_run_a_lab_say_after_which(student):
    for path in sorted((student / "lessons").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        needs = [n for n in LABS if n <= handout.LESSON_TOPIC[path.name[:2]]]
        note = "".join(cells[1]["source"]) if cells[1].get("id") == "handout-note" else ""
        if needs:
            assert note.startswith(f"> **After lab {needs[-1]}.**"), path.name
        else:
            assert not note, path.name
    assert set(handout.LESSON_TOPIC) == {p.name[:2] for p in (Path(REPO) / "lessons").glob("*.ipynb")}


def test_bad_input_is_one_message_and_changes_nothing(tmp_path):
    for args, words in [(["--labs", "0-3"], "--labs '0-3': no lab 0;"), (["--labs", "two"], "use numbers and ranges")]:
        proc = subprocess.run([sys.executable, "-m", "minizero_course", "handout", str(tmp_path / "out"), *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    proc = subprocess.run([sys.executable, "-m", "minizero_course", "handout", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "exists" in proc.stderr and not any((tmp_path / "out").iterdir())


def test_make_handout_gives_every_lab_as_the_command_does():
    """`make handout` runs the command with its own default (every lab: a lab left out ships its reference
    code), and HANDOUT_LABS still narrows it."""
    def dry(*extra):
        proc = subprocess.run(["make", "-n", "handout", *extra], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stdout.splitlines() if "-m minizero_course handout" in line]
    assert len(dry()) == 1 and "--labs" not in dry()[0], dry()
    assert dry("HANDOUT_LABS=1-6")[0].endswith("--labs 1-6"), dry("HANDOUT_LABS=1-6")


def test_every_command_of_the_students_readme_works_there(student, tmp_path):
    """The handout's README is the student's own: each command it gives is run in the handout
    (make's targets dry, as they install .venv first; `.venv/bin/` is this environment's), and fails
    only as an untouched lab does, naming the file to write."""
    text = (student / "README.md").read_text()
    assert "make site" not in text and "make check" not in text and "--impl labs" not in text
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = [line.strip() for block in blocks for line in block.splitlines()
                if line.strip() and not line.startswith("#")]
    assert len(commands) == 7, commands
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(student), str(copy)], check=True)
    bindir = os.path.dirname(sys.executable)
    for command in commands:
        words = shlex.split(command.replace(".venv/bin/", bindir + "/"))
        if words[0] == "make":
            proc = in_handout(copy, "make", "-n", *words[1:], timeout=60)
            assert proc.returncode == 0, (command, proc.stderr)
        elif words[:3] == [sys.executable, "-m", "minizero_course"]:
            proc = in_handout(copy, *words, timeout=300)
            said = "every TODO in minizero/comm/ring.py is still its stub"
            assert proc.returncode == 1 and said in proc.stdout, (command, proc.stdout[-2000:])
        elif words[0].endswith("mpirun"):
            proc = in_handout(copy, *words, timeout=300)
            said = proc.stdout + proc.stderr
            assert "lab 1: not implemented yet" in said, (command, said[-2000:])
        elif words[0].endswith("jupyter"):
            assert os.path.exists(words[0]) and (copy / words[2]).is_dir(), command
            proc = in_handout(copy, words[0], "lab", "--version", timeout=60)
            assert proc.returncode == 0, (command, proc.stderr)
        else:
            proc = in_handout(copy, "bash", "-c", command, timeout=60)
            assert proc.returncode == 0, (command, proc.stderr)
    log = in_handout(copy, "git", "log", "--oneline")
    assert log.stdout.count("\n") == 1, log.stdout + log.stderr
    assert "the handout as given" in log.stdout, log.stdout
