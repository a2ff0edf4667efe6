"""Every lesson notebook runs top to bottom (in a fresh kernel, cwd = repo root), plots what it
measured, and is committed without outputs.

Time: the budget is ~60 s on 2 idle cores (BUDGET_S leaves a margin). It is not asserted: other
jobs share the machine, and a notebook that takes 2x as long at load 10 is not broken. A notebook
over budget gets a warning with the load it ran at; only a hang (a cell past HANG_S) fails.

The lessons run two at a time (Executions), as `make site` runs them. Each executed notebook is
kept in build/lessons/ (docs/site/notebooks.py): `make site` renders those copies instead of running
the lessons a second time."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "lessons").glob("*.ipynb"))
BUDGET_S = 90  # the target is 60 s on 2 idle cores; over it -> a warning naming the load
# Every lesson's title, as the site's navigation lists it: "NN · Topic: what the lesson does", NN
# its file's number, the topic capitalised, what follows the colon in lower case (or a number,
# `code`).
LESSON_TITLE = re.compile(r"(\d\d) · ([A-Z0-9][^:·]*[^:· ]): ([a-z0-9`][^·]*)")


def solution_text_in(text: str) -> list[str]:
    """What of a lab's solution `text` shows: a region's marker or one of its code lines (labgen.solution_lines)."""
    from minizero_course.grader.labgen import solution_lines
    found = [marker for marker in ("BEGIN SOLUTION", "END SOLUTION") if marker in text]
    return found + [f"lab {n}: {line}" for n, lines in solution_lines().items() for line in sorted(lines)
                    if line in text]


def cell_texts(nb) -> str:
    """Every cell's source and every stored output's text (streams, text/plain, markdown, html, errors)."""
    parts = []
    for cell in nb["cells"]:
        parts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")))
            parts += ["".join(v) for k, v in out.get("data", {}).items() if k.startswith("text/")]
            parts.append("\n".join(out.get("traceback", [])))
    return "\n".join(parts)


def test_the_solution_scan_finds_a_printed_solution():
    """The scan below would see a lesson that prints a lab's function from the package (its solution)."""
    import inspect

    from minizero_course.grader import HANDOUT
    from minizero.moe import dispatch
    if HANDOUT:
        pytest.skip("a handout has no marked solution to look for")
    assert solution_text_in(inspect.getsource(dispatch.expert_positions))
    assert not solution_text_in(open(ROOT / "labs" / "lab12_moe_dispatch.py").read())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_lesson_shows_a_solution(path):
    """No lesson's source or stored output holds a lab's solution text (executed outputs: test_lesson_executes)."""
    assert not solution_text_in(cell_texts(json.loads(path.read_text()))), path.name


def title_problem(stem: str, title: str):
    """Why `title` is not in the lessons' one style for lesson `stem`, or None."""
    m = LESSON_TITLE.fullmatch(title)
    if m is None:
        return f"{stem}: {title!r} is not 'NN · Topic: what it does'"
    if m.group(1) != stem[:2]:
        return f"{stem}: {title!r} carries the number {m.group(1)}"
    return None


def test_the_title_style_check_catches_other_styles():
    assert title_problem("07_offload", "07 · Offload: device, host and disk") is None
    assert title_problem("07_offload", "Lesson 07: offload — device, host and disk")
    assert title_problem("07_offload", "08 · Offload: device, host and disk")
    assert title_problem("07_offload", "07 · offload: device, host and disk")
    assert title_problem("07_offload", "07 · Offload — device, host and disk")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_title_has_the_one_style(path):
    """The first cell's heading is the page's title on the site: one style for all of them."""
    first = json.loads(path.read_text())["cells"][0]
    line = "".join(first["source"]).split("\n")[0]
    assert first["cell_type"] == "markdown" and line.startswith("# "), \
        f"{path.name}: no title first"
    problem = title_problem(path.stem, line[2:])
    assert problem is None, problem


def test_there_are_lessons():
    assert [p.name[:2] for p in NOTEBOOKS][:2] == ["00", "01"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count"))]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; strip them before committing"


class Executions:
    """The lessons this session selected, executed two at a time as `make site` executes them
    (docs/site/build.py: one lesson's waits on its kernel and its ranks' start overlap the other's
    work), each in a Python of its own (nbclient's event loop is not one to share between threads).
    All are queued at the first lesson test; each test waits for its own lesson only."""

    def __init__(self, paths):
        self.procs: list = []
        self.pool = ThreadPoolExecutor(2)
        self.futures = {path: self.pool.submit(self._execute, path) for path in paths}

    def _execute(self, path):
        code = ("import sys; from pathlib import Path; from docs.site.notebooks import execute; "
                "execute(Path(sys.argv[1]))")  # a cell past notebooks.HANG_S fails as hung
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        out, _ = proc.communicate()
        return proc.returncode, out

    def result(self, path):
        """The executed notebook and its seconds; fails with the lesson's error where it failed."""
        import nbformat

        from docs.site.notebooks import EXECUTED
        code, out = self.futures[path].result()
        out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # the traceback's colours
        assert code == 0, f"{path.name} failed when executed:\n{out[-4000:]}"
        nb = nbformat.read(EXECUTED / path.name, as_version=4)
        return nb, nb.metadata["minizero_run"]["seconds"]

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in self.procs:  # a session stopped early (-x): no lesson runs on behind it
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def executions(request):
    paths = [item.callspec.params["path"] for item in request.session.items
             if getattr(item, "originalname", "") == "test_lesson_executes"]
    runs = Executions(paths)
    yield runs
    runs.close()


@pytest.mark.launches  # a kernel and the lesson's own ranks: not in `make check`
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_executes(path, executions):
    nb, elapsed = executions.result(path)
    if elapsed > BUDGET_S:
        warnings.warn(f"{path.name} took {elapsed:.0f}s (budget {BUDGET_S} s on idle cores, one lesson "
                      f"at a time) beside another lesson, at load average {os.getloadavg()[0]:.1f} on "
                      f"{os.cpu_count()} cores")
    # the lesson must have produced at least one plot from its measurements
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name} produced no plot"
    shown = solution_text_in(cell_texts(nb))
    assert not shown, f"{path.name} shows a lab's solution when it runs: {shown[:3]}"
