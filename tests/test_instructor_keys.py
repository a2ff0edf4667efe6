"""instructors/: an answer key and a rubric for every lesson's exercises, kept out of the student's
handout and out of the course website.

Format of instructors/answers/NN_name.md (one per lessons/NN_name.ipynb), checked here:
  * a line `**Total: T pts**`;
  * one `## Exercise K: title` section per exercise of the notebook's Exercises cell, K = 1..n;
  * in each, `### Answer`, `### Common wrong answers` and `### Rubric (N pts)`, the rubric's
    bullet lines each ending in `(k pts)` (or `(1 pt)`) and adding up to N; all N add up to T."""
import json
import re
from pathlib import Path

import pytest

# The two course builders this file checks: update these imports (only here) if they move.
from docs.site import build as site_build
from minizero_course.kit import handout

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = ROOT / "instructors" / "answers"
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
POINTS = re.compile(r"\((\d+) pts?\)\s*$")


def exercise_count(notebook: Path) -> int:
    """The numbered items (`1.`, `2.`, ... starting a line) of the `## Exercises` cell."""
    for cell in json.loads(notebook.read_text())["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and re.search(r"^## Exercises\s*$", text, flags=re.M):
            section = re.split(r"^## Exercises\s*$", text, flags=re.M)[1]
            section = re.split(r"^## ", section, flags=re.M)[0]
            return len(re.findall(r"^\d+\. ", section, flags=re.M))
    raise AssertionError(f"{notebook.name} has no '## Exercises' cell")


def sections(text: str) -> list[tuple[int, str]]:
    """[(K, body)] of each `## Exercise K: ...` section."""
    parts = re.split(r"^## Exercise (\d+):.*$", text, flags=re.M)
    return [(int(parts[i]), parts[i + 1]) for i in range(1, len(parts), 2)]


def bullets(text: str) -> list[str]:
    """The `- ` items of a list, each with its indented continuation lines joined on."""
    items = []
    for line in text.splitlines():
        if line.startswith(("- ", "* ")):
            items.append(line)
        elif items and line.startswith("  ") and line.strip():
            items[-1] += " " + line.strip()
    return items


def test_every_lesson_has_an_answer_file():
    assert len(LESSONS) == 16
    missing = [nb.stem for nb in LESSONS if not (ANSWERS / f"{nb.stem}.md").is_file()]
    assert not missing, f"no answer key in instructors/answers/ for {missing}"
    extra = sorted({p.stem for p in ANSWERS.glob("*.md")} - {nb.stem for nb in LESSONS})
    assert not extra, f"answer keys for no lesson: {extra}"
    assert (ROOT / "instructors" / "README.md").is_file()


@pytest.mark.parametrize("notebook", LESSONS, ids=[nb.stem for nb in LESSONS])
def test_every_exercise_is_answered_with_a_rubric_that_adds_up(notebook):
    text = (ANSWERS / f"{notebook.stem}.md").read_text()
    n = exercise_count(notebook)
    found = sections(text)
    assert [k for k, _ in found] == list(range(1, n + 1)), \
        f"{notebook.stem}: the notebook has {n} exercises, the key answers {[k for k, _ in found]}"
    total = 0
    for k, body in found:
        for heading in ("### Answer", "### Common wrong answers"):
            assert re.search(rf"^{heading}\s*$", body, flags=re.M), \
                f"{notebook.stem} exercise {k}: no {heading}"
        rubric = re.search(r"^### Rubric \((\d+) pts\)\s*$(.*)", body, flags=re.M | re.S)
        assert rubric, f"{notebook.stem} exercise {k}: no '### Rubric (N pts)'"
        parts = [int(m.group(1)) for item in bullets(rubric.group(2)) if (m := POINTS.search(item))]
        assert parts and sum(parts) == int(rubric.group(1)), \
            f"{notebook.stem} exercise {k}: rubric lines {parts} do not add up to {rubric.group(1)}"
        total += int(rubric.group(1))
    stated = re.search(r"^\*\*Total: (\d+) pts\*\*\s*$", text, flags=re.M)
    assert stated and int(stated.group(1)) == total, f"{notebook.stem}: stated total != {total}"


def test_answer_files_keep_lines_short():
    for path in [ROOT / "instructors" / "README.md", *ANSWERS.glob("*.md")]:
        long = [i for i, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 100]
        assert not long, f"{path.name}: lines over 100 columns: {long}"


def _answer_lines() -> set[str]:
    """Distinctive lines of the keys (long enough not to occur by chance in a lesson or a page)."""
    lines = set()
    for path in ANSWERS.glob("*.md"):
        lines |= {line.strip() for line in path.read_text().splitlines() if len(line.strip()) >= 60}
    return lines


def test_the_site_sources_hold_no_answer_key(tmp_path):
    """The site stages README.md, docs/*.md, lessons/ and labs/ (docs/site/build.py): instructors/
    is none of them, and no staged page holds a line of a key (docs/instructors.md names it)."""
    assert not any(name.startswith("instructors") for name in site_build.SOURCES)
    site_build.stage_docs(tmp_path)
    keys = _answer_lines()
    for page in tmp_path.rglob("*"):
        if page.is_file() and page.suffix == ".md":
            text = page.read_text()
            leaked = [line for line in keys if line in text]
            assert not leaked, f"site page {page.name} holds key lines: {leaked[:3]}"


def test_the_handout_leaves_out_the_instructors_folder(tmp_path):
    """Built for real (file copies, a few seconds): no instructors/ and no test that needs it."""
    tracked = handout.repository_files()
    assert any(p.startswith("instructors/answers/") for p in tracked), "no instructors/"
    out = tmp_path / "student"
    changed = handout.build(str(out), [1])
    assert not (out / "instructors").exists()
    assert not (out / "tests" / Path(__file__).name).exists()
    assert any(p.startswith("instructors/") for p in changed["left out"])
    keys = _answer_lines()
    for path in out.rglob("*.md"):
        text = path.read_text()
        assert not [line for line in keys if line in text], f"handout file {path} holds key lines"
