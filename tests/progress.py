"""A pytest plugin (`-p tests.progress`, on in `make test`): one line per test file when its last
test is done, with its test count, its seconds, the load average and an estimate of the time left:

    tests/test_comm.py: 14 tests, 41.2 s, load 3.10 2.05 1.20 (2 cores) | 12 of 108 files,
    about 17 min left                                          (one line in the output)

The whole suite runs for many minutes with `-q`'s dots only; these lines say where it stands and,
when it is slow, whether the machine is busy (a load average above the cores). The estimate is the
last run's seconds for the files still to come (build/test-times.json, each file's seconds,
tests/conftest.py; on a fresh clone, with no run yet, tests/test-times.json: the seconds of an idle
fresh-clone CI run, committed), times this run's pace so far against that run's on the same files; a file the
last run did not time counts its tests at that run's mean seconds per test. -q's summary and
closing line are untouched.
"""
from __future__ import annotations

import json
import os

MIN_PACE_S = 5.0  # fewer seconds done than this: too little to compare with the last run (pace 1)
NO_ESTIMATE = ("no estimate (no earlier times of these files in build/test-times.json or "
               "tests/test-times.json)")


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _span(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


class Progress:
    def __init__(self, config):
        self.config = config
        self.counts: dict = {}  # file -> its tests this run, in run order
        self.done: dict = {}  # file -> tests finished
        self.seconds: dict = {}  # file -> seconds so far (setup + call + teardown)
        self.finished: list = []
        root = str(config.rootpath)
        self.earlier = (self._earlier(os.path.join(root, "build", "test-times.json"))
                        or self._earlier(os.path.join(root, "tests", "test-times.json")))

    @staticmethod
    def _earlier(path: str) -> dict:
        try:
            with open(path) as f:
                return {k: float(v) for k, v in json.load(f).get("file_s", {}).items()}
        except (OSError, ValueError, AttributeError):
            return {}  # no earlier run, or a file from another version: no estimate

    def pytest_collection_finish(self, session):
        for item in session.items:
            name = _file(item.nodeid)
            self.counts[name] = self.counts.get(name, 0) + 1

    def pytest_runtest_logreport(self, report):
        name = _file(report.nodeid)
        self.seconds[name] = self.seconds.get(name, 0.0) + report.duration

    def pytest_runtest_logfinish(self, nodeid, location):
        name = _file(nodeid)
        self.done[name] = self.done.get(name, 0) + 1
        if self.done[name] == self.counts.get(name):
            self.finished.append(name)
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                if reporter._tw.width_of_current_line:  # after -q's dots: a line of its own
                    reporter.write("\n")
                reporter.write_line(self.line(name))

    def left_s(self) -> float | None:
        """Seconds still to run, estimated; None with nothing to estimate from."""
        known = {f: s for f, s in self.earlier.items() if f in self.counts}
        if not known:
            return None
        per_test = sum(known.values()) / sum(self.counts[f] for f in known)
        rest = [f for f in self.counts if f not in self.finished]
        before = sum(known.get(f, per_test * self.counts[f]) for f in rest)
        compared = [f for f in self.finished if f in known]
        then = sum(known[f] for f in compared)
        now = sum(self.seconds.get(f, 0.0) for f in compared)
        return before * (now / then if then >= MIN_PACE_S else 1.0)

    def line(self, name: str) -> str:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        left = self.left_s()
        estimate = NO_ESTIMATE if left is None else f"about {_span(left)} left"
        n, seconds = self.counts[name], self.seconds.get(name, 0.0)
        return (f"{name}: {n} test{'s' * (n != 1)}, {seconds:.1f} s, load {load} "
                f"({os.cpu_count()} cores) | {len(self.finished)} of {len(self.counts)} files, "
                f"{estimate}")


def pytest_configure(config):
    config.pluginmanager.register(Progress(config), "minizero-progress")
