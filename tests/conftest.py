import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)  # launch targets like "tests/comm_workers.py:fn" are relative to the repo root
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every launch.run of the session and of the processes it starts (the grader, the lessons' kernels)
# waits its timeout times the load per core: the timeouts in tests, lessons and lab checks are
# deadlock guards for an idle machine, and a loaded one must not turn them into verdicts.
os.environ.setdefault("MINIZERO_TIMEOUT_SCALE", "load")


@pytest.fixture(scope="session")
def impl(request):
    return request.config.getoption("--impl")


@pytest.fixture(scope="session")
def graded(request, impl, tmp_path_factory):
    """graded(lab, impl) -> the lab's Gradescope result; graded.mutant(...), graded.started_lab(...): every
    grading this session's tests need, run once in shared launches (tests/shared_grading.py)."""
    from tests.shared_grading import SharedGrading
    shared = SharedGrading(request.session, impl, tmp_path_factory)
    yield shared
    _TIMES["grade_s"]["shared batch"] = shared.seconds


_ZYGOTE_SHARED: dict = {}


def pytest_runtest_setup(item):
    """pytest's faulthandler_timeout (pyproject.toml) dumps every thread's stack when a test runs
    longer: a hang's trace on an idle machine, noise on a busy one (a module's launch past 300 s at
    load 20). Re-armed here, inside pytest's own arming, with the limit scaled to the machine now."""
    if item.get_closest_marker("launches") is not None and "shared" not in _ZYGOTE_SHARED:
        # one zygote for the session's launches and for those of the processes it starts (the
        # lessons' kernels, the grader's commands): torch imported once, not once per process
        from minizero import launch
        _ZYGOTE_SHARED["shared"] = launch.share_zygote()
    limit = float(item.config.getini("faulthandler_timeout") or 0)
    if limit > 0:
        from tests.machine import dump_stacks_after, guard
        dump_stacks_after(item.config, guard(limit))


def pytest_collection_modifyitems(config, items):
    """A test that starts ranks or processes is marked `launches` in its file (pytestmark or a
    decorator): the slow part of the suite, left out of `make check` (-m "not launches"). The
    grader's fixture starts them too, so a test that uses it is marked here."""
    for item in items:
        if "graded" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.launches)


class ProcessStarted(RuntimeError):
    """A test not marked `launches` started a process."""


@contextlib.contextmanager
def no_process_unless_marked(item):
    """Around a test's setup, call and teardown: Popen raises where the test is not marked
    `launches`, naming the test and the mark to add, so the marks cannot fall behind the code."""
    if item.get_closest_marker("launches") is not None:
        yield
        return
    real = subprocess.Popen.__init__

    def refuse(self, args, *a, **k):
        raise ProcessStarted(f"{item.nodeid} starts a process ({str(args)[:80]}) but is not marked "
                             "launches: add `pytestmark = pytest.mark.launches` to its file (or "
                             "@pytest.mark.launches to the test)")
    subprocess.Popen.__init__ = refuse
    try:
        yield
    finally:
        subprocess.Popen.__init__ = real


@pytest.hookimpl(hookwrapper=True, specname="pytest_runtest_setup")
def pytest_no_process_in_setup(item):
    with no_process_unless_marked(item):
        yield


@pytest.hookimpl(hookwrapper=True, specname="pytest_runtest_call")
def pytest_no_process_in_call(item):
    with no_process_unless_marked(item):
        yield


@pytest.hookimpl(hookwrapper=True, specname="pytest_runtest_teardown")
def pytest_no_process_in_teardown(item):
    with no_process_unless_marked(item):
        yield


# The time every user waits, from this run (build/test-times.json): each test's seconds (setup + call +
# teardown), each file's, each grading run's, and the load average at the start and the end, so a table of
# waiting times says whether the machine was idle when it was measured. A file this run did not run
# keeps its seconds from the run that last did: tests/progress.py estimates the time left from them.
_TIMES = {"grade_s": {}, "test_s": {}}


def pytest_sessionstart(session):
    _TIMES["start"], _TIMES["load_at_start"] = time.time(), os.getloadavg()


def pytest_runtest_logreport(report):
    _TIMES["test_s"][report.nodeid] = round(_TIMES["test_s"].get(report.nodeid, 0.0) + report.duration, 2)


def pytest_sessionfinish(session):
    if "start" not in _TIMES or not _TIMES["test_s"]:
        return
    files = {}
    for nodeid, seconds in _TIMES["test_s"].items():
        files[nodeid.split("::")[0]] = round(files.get(nodeid.split("::")[0], 0.0) + seconds, 1)
    report = {"wall_s": round(time.time() - _TIMES["start"], 1), "load_at_start": _TIMES["load_at_start"],
              "load_at_end": os.getloadavg(), "tests": len(_TIMES["test_s"]), "file_s": files,
              "grade_s": _TIMES["grade_s"], "test_s": _TIMES["test_s"]}
    # TEST_TIMES_JSON: elsewhere, for a run inside a test (test_busy_machine.py: no real timing)
    path = os.environ.get("TEST_TIMES_JSON") or os.path.join(ROOT, "build", "test-times.json")
    try:
        with open(path) as f:
            files = {**json.load(f)["file_s"], **files}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no earlier run: this run's files only
    report["file_s"] = files
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
