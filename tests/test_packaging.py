"""Set-up files agree with each other, and the README's commands are the ones CI runs."""
import re
import tomllib
from pathlib import Path
import pytest

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = Path(__file__).resolve().parent.parent


def _pins(lines):
    return dict(re.match(r"^\s*([A-Za-z0-9_.-]+)==(\S+)\s*$", line).groups() for line in lines
                if re.match(r"^\s*[A-Za-z0-9_.-]+==\S+\s*$", line))


def test_environment_yml_has_the_same_pins_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["dev"]
    py_pins = _pins(deps)
    yml = (ROOT / "environment.yml").read_text()
    yml_pins = _pins(m.group(1) for m in re.finditer(r"^\s*-\s+(\S+==\S+)\s*$", yml, re.M))
    assert py_pins, "no pins found in pyproject.toml"
    assert yml_pins == py_pins
    for must in ("torch", "mpi4py", "mpich", "numpy", "matplotlib", "tqdm", "pytest", "nbclient", "ipykernel"):
        assert must in py_pins, f"{must} is not pinned"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^make test$", ci, re.M)
    assert "make demo" in readme and "make test" in readme


def test_the_readme_is_a_front_page_and_its_links_resolve():
    """The README stays short (the reference lives in docs/), every relative link in it and in the docs/ pages
    names a file that exists, and none of them speaks of the project's own history."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    lessons, labs = len(list((ROOT / "lessons").glob("*.ipynb"))), len(list((ROOT / "labs").glob("lab*.py")))
    assert f"{lessons} lessons" in readme and f"{labs} labs" in readme, "the README's counts of lessons and labs"
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken, internal = [], []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"^[a-z]+:", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
        if page.name != "design.md":
            internal += [f"{page.relative_to(ROOT)}: {m}" for m in
                         re.findall(r"\bissue \d+|seed article|this session|other helpers", text, re.I)]
    assert not broken, broken
    assert not internal, internal
