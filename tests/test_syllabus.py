"""docs/syllabus.md's times are measured, not typed: its table is the rendering of docs/syllabus_times.json
(written by `python -m docs.site.syllabus measure`), which holds a run of every lesson and every lab."""
import json
from pathlib import Path

from docs.site import syllabus

ROOT = Path(__file__).resolve().parent.parent


def test_the_page_shows_the_rendering_of_the_measured_times():
    page = syllabus.PAGE.read_text()
    start, end = page.index(syllabus.BEGIN) + len(syllabus.BEGIN), page.index(syllabus.END)
    rendered = syllabus.table(json.loads(syllabus.TIMES.read_text()))
    assert page[start:end].strip() == rendered.strip(), "docs/syllabus.md is stale: python -m docs.site.syllabus write"


def test_every_lesson_and_lab_was_measured():
    """A new or renamed lesson or lab needs a new measurement: the JSON names each one, with a time and the
    load it ran at, and each lab's reference solution graded without an error."""
    from minizero_course.grader import LABS
    data = json.loads(syllabus.TIMES.read_text())
    assert sorted(data["lessons"]) == sorted(p.stem for p in (ROOT / "lessons").glob("*.ipynb"))
    assert sorted(data["labs"]) == [f"{n:02d}" for n in sorted(LABS)]
    for t in [*data["lessons"].values(), *data["labs"].values()]:
        assert t["seconds"] > 0 and len(t["load_before"]) == 3 and len(t["load_after"]) == 3
    assert all(t["exit"] == 0 for t in data["labs"].values()), {n: t["exit"] for n, t in data["labs"].items()}


def test_lab_size_counts_the_solution_regions():
    """Lab 01's reference, minizero/comm/ring.py, has two marked regions; their code is what the student
    writes, so it is more than a line and less than the module."""
    tasks, lines = syllabus.lab_size(1)
    module = (ROOT / "minizero" / "comm" / "ring.py").read_text().splitlines()
    assert tasks == sum(line.strip() == "# END SOLUTION" for line in module) == 2
    assert 1 < lines < len(module)
    assert syllabus.lab_hours(2, 12) == 4.0  # 2 + 0.5·2 + 0.1·12 = 4.2, to the half hour
