"""ruff, configured in pyproject.toml ([tool.ruff]), finds nothing in the repository; and its configuration
is the one that is read (a rule it selects is reported on a file that breaks it)."""
import shutil
import subprocess
import sys
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
