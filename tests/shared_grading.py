"""Every grading the selected tests need, in one batch: the fixture `graded` of tests/conftest.py.

A lab check launches ranks, and a launch costs seconds of start-up. The tests grade the same checks
many times over: each lab's solutions (tests/test_labs.py, tests/test_grader.py), each student bug of
tests/mutants on its one check, and each check on a started but unfinished lab. Graded one by one that
is hundreds of launches; `minizero_course.grader.batch.run_checks` grades them all in shared jobs, one per
rank count and round, with each entry exactly what `run_check` gives alone. The batch runs at the first
test that asks for a grade and covers every test this session selected (so `pytest -k lab3` grades
lab 3 only). The `grade` command itself, one lab at a time as a user runs it, is tested on its own.
"""
from __future__ import annotations

import faulthandler
import time
from pathlib import Path

from minizero_course.grader import LABS, REPO, _result, stretch_policy
from minizero_course.grader.batch import run_checks

# A line outside every TODO: the lab counts as started, so its checks launch its ranks instead of the
# grader's shortcut for an untouched file (grader.untouched_todos).
STARTED = "\n\nSTARTED = True  # a line outside the TODOs: graded by its ranks\n"


# the tests of tests/test_mutants.py that grade a mutant on its check
GRADED_BY = ("test_mutant_loses_marks", "test_stretch_points_never_make_up_for_a_failed_main_check")


def mutant_key(number: int, mutant) -> tuple:
    from tests.test_mutants import MUTANTS
    return number, MUTANTS[number].index(mutant)


class SharedGrading:
    def __init__(self, session, impl: str, tmp_path_factory):
        self.tmp, self.impl, self.ran, self.seconds = tmp_path_factory, impl, False, 0.0
        self.config = session.config
        self.dump_after_s = float(session.config.getini("faulthandler_timeout") or 0)
        self.labs: set = set()  # (lab, impl): every check of the lab
        self.mutants: dict = {}  # (lab, index) -> Mutant
        self.started: set = set()  # (lab, check name): the check on the started, unfinished lab
        for item in session.items:
            name = item.originalname if hasattr(item, "originalname") else item.name
            params = item.callspec.params if hasattr(item, "callspec") else {}
            if name == "test_lab_check":
                self.labs.add((params["lab"], impl))
            elif name == "test_solutions_score_full_marks_in_gradescope_format":
                self.labs.add((params["lab"], "solutions"))
            elif name in GRADED_BY:
                self.mutants[mutant_key(params["number"], params["mutant"])] = params["mutant"]
            elif name == "test_every_check_depends_on_the_students_file":
                from tests.test_mutants import MUTANTS
                self.started |= {(n, c.fn.__name__) for n, lab in LABS.items() for c in lab.checks()
                                 if c.fn.__name__ not in {m.check for m in MUTANTS.get(n, [])}}
        self.results: dict = {}  # (lab, impl) -> Gradescope result
        self.entries: dict = {}  # ("mutant", lab, index) or ("started", lab, check) -> entry or AssertionError

    def _run(self):
        # The batch is every selected test's grading at once (minutes), inside the first test
        # that asks: no stack dump for outliving one test's faulthandler_timeout. Each of its
        # launches has its own timeout (a deadlock guard scaled to the load, tests/conftest.py).
        faulthandler.cancel_dump_traceback_later()
        try:
            self._run_batch()
        finally:
            if self.dump_after_s > 0:  # the rest of the test is guarded as pytest guards every test
                from tests.machine import dump_stacks_after, guard
                dump_stacks_after(self.config, guard(self.dump_after_s))

    def _run_batch(self):
        from tests.test_mutants import mutate  # staff-only (not in a handout), as are the tests that need it
        self.ran, start = True, time.perf_counter()
        jobs, keys = [], []
        for lab, impl in sorted(self.labs):
            for check in LABS[lab].checks():
                jobs.append((LABS[lab], check, impl))
                keys.append(("lab", lab, impl))
        for (n, k), mutant in sorted(self.mutants.items(), key=lambda kv: kv[0]):
            folder = self.tmp.mktemp(f"lab{n:02d}-mutant{k}")
            try:
                mutate(LABS[n], mutant, folder)
            except AssertionError as e:  # a stale patch fails its own test, not every mutant's
                self.entries["mutant", n, k] = e
                continue
            jobs.append((LABS[n], {c.fn.__name__: c for c in LABS[n].checks()}[mutant.check], str(folder)))
            keys.append(("mutant", n, k))
        folders = {}
        for n, check_name in sorted(self.started):
            if n not in folders:
                folders[n] = self.tmp.mktemp(f"lab{n:02d}-started")
                source = Path(REPO) / "labs" / LABS[n].filename
                (folders[n] / LABS[n].filename).write_text(source.read_text() + STARTED)
            jobs.append((LABS[n], {c.fn.__name__: c for c in LABS[n].checks()}[check_name], str(folders[n])))
            keys.append(("started", n, check_name))
        by_lab: dict = {}
        for key, entry in zip(keys, run_checks(jobs)):
            if key[0] == "lab":
                by_lab.setdefault(key[1:], []).append(entry)
            else:
                self.entries[key] = entry
        for (lab, impl), entries in by_lab.items():
            stretch_policy(LABS[lab], LABS[lab].checks(), entries)
            self.results[lab, impl] = _result(entries)
        self.seconds = round(time.perf_counter() - start, 1)

    def _entry(self, key):
        if not self.ran:
            self._run()
        entry = self.entries[key]
        if isinstance(entry, AssertionError):
            raise entry
        return entry

    def __call__(self, lab: int, impl: str) -> dict:
        """The Gradescope result of every check of `lab` on `impl`, the stretch policy applied, as
        `python -m minizero_course grade --lab N --impl IMPL --json` writes it."""
        if not self.ran:
            self._run()
        return self.results[lab, impl]

    def mutant(self, number: int, mutant) -> dict:
        return self._entry(("mutant", *mutant_key(number, mutant)))

    def started_lab(self, number: int, check_name: str) -> dict:
        return self._entry(("started", number, check_name))

    def table(self) -> str:
        """The mutant table (lab, mutant, check, score, the message's first line), in Markdown."""
        from tests.test_mutants import MUTANTS
        rows = ["| lab | mutant | check | score | message |", "|---|---|---|---|---|"]
        for (kind, number, k), e in sorted((key, e) for key, e in self.entries.items() if key[0] == "mutant"):
            m = MUTANTS[number][k]
            if isinstance(e, AssertionError):
                rows.append(f"| {number} | {m.name} | {m.check} | - | stale patch: {e} |")
                continue
            lines = [line for line in e["output"].splitlines() if line.strip()]
            said = " ".join(lines[:1] + [line for line in lines[1:2] if line.startswith("likely cause:")])
            rows.append(f"| {number} | {m.name} | {m.check} | {e['score']:g}/{e['max_score']:g} | "
                        f"{said.replace('|', '/')[:300]} |")
        return "\n".join(rows) + "\n"
