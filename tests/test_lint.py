"""ruff, configured in pyproject.toml ([tool.ruff]) and, for the library, minizero/ruff.toml (100 columns),
finds nothing in the repository; and its configuration is the one that is read (a rule it selects is
reported on a file that breaks it)."""
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = Path(__file__).resolve().parent.parent


def ruff(*args, **kwargs):
    exe = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("ruff is not installed: pip install ruff==0.17.6 (pyproject's dev extra)")
    return subprocess.run([exe, "check", "--no-cache", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, **kwargs)


def test_the_repository_is_clean():
    out = ruff(".", "--output-format", "concise")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_configuration_is_read():
    """An unused import, a line of 120 characters (allowed) and one of 121, checked as a file of the repository."""
    source = "import os\nx = '" + "a" * 114 + "'\ny = '" + "a" * 115 + "'\n"
    out = ruff("--stdin-filename", "tests/example.py", "--output-format", "concise", "-", input=source)
    assert out.returncode == 1
    found = [line.split(": ")[1].split()[0] + "@" + line.split(":")[1] for line in out.stdout.splitlines()
             if ": " in line]
    assert found == ["F401@1", "E501@3"], out.stdout


def test_the_library_reads_at_100_columns():
    """minizero/ruff.toml: a line of 100 characters (allowed) and one of 101, checked as a library file."""
    source = "x = '" + "a" * 94 + "'\ny = '" + "a" * 95 + "'\n"
    out = ruff("--stdin-filename", "minizero/example.py", "--output-format", "concise", "-", input=source)
    assert out.returncode == 1
    found = [line.split(": ")[1].split()[0] + "@" + line.split(":")[1] for line in out.stdout.splitlines()
             if ": " in line]
    assert found == ["E501@2"], out.stdout


SOLUTION = re.compile(r"BEGIN SOLUTION.*?END SOLUTION", re.S)


def test_the_librarys_e501_exceptions_hide_only_solution_regions():
    """A library file exempted from E501 by minizero/ruff.toml has its long lines inside BEGIN/END
    SOLUTION only, and has at least one there; the exemptions name files, never a whole folder."""
    config = tomllib.loads((ROOT / "minizero" / "ruff.toml").read_text())
    exempt = [k for k, v in config["lint"]["extend-per-file-ignores"].items() if "E501" in v]
    assert exempt and not [k for k in exempt if "*" in k or not k.endswith(".py")], exempt
    for name in exempt:
        text = (ROOT / "minizero" / name).read_text()
        inside = set()
        for m in SOLUTION.finditer(text):
            first = text.count("\n", 0, m.start())
            inside.update(range(first, first + m.group(0).count("\n") + 1))
        long = [i for i, line in enumerate(text.splitlines()) if len(line) > 100]
        assert long and set(long) <= inside, (name, [i + 1 for i in long if i not in inside])
