"""The library's size, stated truly: the README's total, docs/design.md's lines per folder and its
reading paths (the files a topic is read in) are counted here from the files themselves, every
line (code, docstrings, comments, blank). A stated figure holds while it is within 2% (or 10
lines) of the count: a small edit does not break it, a folder grown by a module does."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "minizero"


def lines(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines())


def library_lines(pkg: pathlib.Path = PKG) -> dict[str, int]:
    """Lines per top-level part of minizero/: each folder, and the top-level modules together."""
    out = {}
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(pkg)
        key = f"{rel.parts[0]}/" if len(rel.parts) > 1 else "top-level modules"
        out[key] = out.get(key, 0) + lines(f)
    return out


def rounded(n: int, to: int) -> int:
    return int(round(n / to)) * to


def holds(stated: int, counted: int) -> bool:
    return abs(stated - counted) <= max(10, 0.02 * counted)


def number(text: str) -> int:
    return int(text.replace(",", ""))


def section(path: pathlib.Path, title: str) -> str:
    text = path.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def table_rows(text: str) -> list[list[str]]:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|")]
    return [r for r in rows[2:]]  # the header and its rule


def test_the_readme_states_the_librarys_lines():
    total = sum(library_lines().values())
    found = re.search(r"minizero/ is ([\d,]+) lines of Python", (ROOT / "README.md").read_text())
    assert found, "the README states the library's size as 'minizero/ is N lines of Python'"
    assert holds(number(found.group(1)), total), \
        f"README says {found.group(1)}; minizero/ has {total:,} lines: write {rounded(total, 100):,}"


def test_design_states_the_lines_per_folder():
    counted = library_lines()
    rows = {r[0].strip("`"): number(r[1]) for r in
            table_rows(section(ROOT / "docs" / "design.md", "The library's size"))}
    want = {k: rounded(v, 10) for k, v in counted.items()}
    assert rows.keys() == want.keys() and all(holds(rows[k], counted[k]) for k in rows), \
        "docs/design.md's size table should read:\n" + "\n".join(f"| `{k}` | {v:,} |" for k, v in want.items())


def test_each_reading_path_states_its_files_lines():
    rows = table_rows(section(ROOT / "docs" / "design.md", "Reading paths"))
    assert len(rows) >= 8, rows
    for topic, files, stated in rows:
        paths = [PKG / f.strip().strip("`") for f in files.split(",")]
        missing = [p for p in paths if not p.is_file()]
        assert not missing, f"{topic}: no such file {missing}"
        total = sum(lines(p) for p in paths)
        assert holds(number(stated), total), f"{topic}: {stated} stated, {total} counted"


def test_a_figure_holds_within_2_percent_or_10_lines():
    assert holds(20_900, 20_909) and holds(1_240, 1_250) and holds(170, 162)
    assert not holds(20_900, 21_400) and not holds(1_240, 1_290) and not holds(170, 185)


def test_the_count_sees_every_line_and_folder(tmp_path):
    """Code, docstrings, comments and blank lines all count, folders apart, top-level modules together."""
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "a.py").write_text('"""doc\nstring"""\n# why\n\nx = 1\n')
    (tmp_path / "env.py").write_text("y = 2\n")
    (tmp_path / "host.py").write_text("\n\n")
    assert library_lines(tmp_path) == {"top-level modules": 3, "zero/": 5}


def test_the_readmes_zero3_figure_is_the_reading_paths():
    rows = {r[0]: number(r[2]) for r in table_rows(section(ROOT / "docs" / "design.md", "Reading paths"))}
    found = re.search(r"ZeRO-3 by hand: (\d) files, about ([\d,]+) lines", (ROOT / "README.md").read_text())
    assert found, "the README gives ZeRO-3's reading path"
    files = [r for r in table_rows(section(ROOT / "docs" / "design.md", "Reading paths"))
             if r[0] == "ZeRO-3 by hand"][0][1].split(",")
    assert (int(found.group(1)), number(found.group(2))) == (len(files), rows["ZeRO-3 by hand"])
