"""`launches` is marked in each test file that starts ranks or processes, and the marks cannot fall
behind the code: tests/conftest.py makes Popen raise inside any test not marked, so `make check`
(-m "not launches") starts no process, and a new test that does fails there naming the mark."""
import subprocess
import sys

import pytest

from tests.conftest import no_process_unless_marked


class _Item:
    nodeid = "tests/test_x.py::test_y"

    def __init__(self, marked):
        self.marked = marked

    def get_closest_marker(self, name):
        return object() if self.marked and name == "launches" else None


def test_an_unmarked_test_cannot_start_a_process():
    before = subprocess.Popen.__init__
    with no_process_unless_marked(_Item(marked=False)):
        with pytest.raises(RuntimeError, match="tests/test_x.py::test_y starts a process .* launches"):
            subprocess.run([sys.executable, "-c", "pass"])
    assert subprocess.Popen.__init__ is before  # put back on the way out


def test_this_file_runs_unmarked():
    """The guard is on for this very test: it is not marked, and Popen refuses here too."""
    with pytest.raises(RuntimeError, match="test_this_file_runs_unmarked starts a process"):
        subprocess.run([sys.executable, "-c", "pass"])
