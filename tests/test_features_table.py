"""docs/features.md, the course against its sources' feature list: every lesson, lab, config and docs page it
names exists, and every lesson and lab of the repository has a row (a new one must be placed in it)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLE = (ROOT / "docs" / "features.md").read_text()


def test_every_path_and_page_the_table_names_exists():
    paths = re.findall(r"`((?:lessons|labs|configs)/[^`]+)`", TABLE)
    pages = re.findall(r"\]\(([\w-]+\.md)\)", TABLE)
    assert len(paths) > 30 and len(pages) > 15
    missing = [p for p in paths if not (ROOT / p).exists()] + [p for p in pages if not (ROOT / "docs" / p).exists()]
    assert not missing, f"docs/features.md names what does not exist: {missing}"


def test_every_lesson_and_lab_has_a_row():
    named = set(re.findall(r"`((?:lessons|labs)/[^`]+)`", TABLE))
    every = {f"lessons/{p.name}" for p in (ROOT / "lessons").glob("*.ipynb")} \
        | {f"labs/{p.name}" for p in (ROOT / "labs").glob("lab*.py")}
    assert every - named == set(), f"not in docs/features.md: {sorted(every - named)}"
    for feature in ("ZeRO-1", "ZeRO-3", "ZeRO-Offload", "ZeRO++", "1-bit Adam", "sparse attention", "pipeline",
                    "mixture of experts", "tensor parallelism", "context parallelism"):
        assert feature in TABLE, feature
