import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)  # launch targets like "tests/comm_workers.py:fn" are relative to the repo root
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def impl(request):
    return request.config.getoption("--impl")


class _GradeCache:
    """Runs `python -m minizero grade --lab N --impl X --json F` once per (lab, impl) and
    keeps the parsed results.json: the per-check tests and the grader's own tests share it
    (multi-rank checks cost seconds each)."""

    def __init__(self, tmp_dir):
        self.tmp_dir, self.cache = tmp_dir, {}

    def __call__(self, lab: int, impl: str):
        import json
        import subprocess
        key = (lab, impl)
        if key not in self.cache:
            out = self.tmp_dir / f"lab{lab}-{impl.replace('/', '_')}.json"
            proc = subprocess.run([sys.executable, "-m", "minizero", "grade", "--lab", str(lab),
                                   "--impl", impl, "--json", str(out)], capture_output=True, text=True, timeout=900)
            result = json.loads(out.read_text()) if out.exists() else None
            self.cache[key] = (proc, result)
        return self.cache[key]


@pytest.fixture(scope="session")
def graded(tmp_path_factory):
    return _GradeCache(tmp_path_factory.mktemp("grades"))


_STARTS_PROCESSES = ("launch.", "subprocess", "nbclient", "mpirun", "torchrun")
_module_starts = {}


def pytest_collection_modifyitems(config, items):
    """Mark `launches` every test that starts ranks or processes (its module calls minizero.launch, subprocess,
    a notebook client or a launcher, or it uses the grader's fixture): the slow part of the suite.
    `make check` runs the rest (python -m pytest -m "not launches")."""
    marker = pytest.mark.launches
    for item in items:
        path = str(item.fspath)
        if path not in _module_starts:
            with open(path) as f:
                text = f.read()
            _module_starts[path] = any(s in text for s in _STARTS_PROCESSES)
        if _module_starts[path] or "graded" in getattr(item, "fixturenames", ()):
            item.add_marker(marker)
