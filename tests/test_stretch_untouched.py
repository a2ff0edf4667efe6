"""A student who solves a lab's main tasks and leaves its stretch task as generated gets full marks and 0
extra: the stretch stub's NotImplementedError is recorded by its own check, never raised into the run the
main checks share (which would fail them all). The file: the solution with only the stretch regions stubbed."""
import pytest

from minizero_course.grader import LABS, run_check
from minizero_course.grader.labgen import BEGIN, END, joined, sources, transform

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`


def main_solved_stretch_stubbed(lab) -> str:
    """The lab's joined source with its non-stretch regions' markers dropped, so transform stubs the rest."""
    kept, inside_main = [], False
    for line in joined(sources(lab)).splitlines():
        m = BEGIN.match(line)
        if m and "(stretch)" not in (m.group("hint") or ""):
            inside_main = True
            continue
        if END.match(line) and inside_main:
            inside_main = False
            continue
        kept.append(line)
    return transform("\n".join(kept), lab.number, stub=True)


@pytest.mark.parametrize("number", [13, 14])
def test_main_checks_full_and_stretch_zero(number, tmp_path):
    lab = LABS[number]
    source = main_solved_stretch_stubbed(lab)
    assert source.count("NotImplementedError(") == 1 and "(stretch)" in source  # only the stretch task stubbed
    (tmp_path / lab.filename).write_text(source)
    for check in lab.checks():
        entry = run_check(lab, check, str(tmp_path))
        if check.extra:
            assert entry["score"] == 0 and "not implemented yet" in entry["output"], entry
        else:
            assert entry["score"] == check.max_score, entry
