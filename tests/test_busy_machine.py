"""The suite's verdicts do not depend on the machine's speed: the tests with the tightest time
limits (a rendezvous wait of a few seconds, a job that must end soon after a rank dies) run again
with the CPU oversubscribed, 2 busy processes per core, and must pass as on an idle machine. Their
limits are deadlock guards scaled to the load (tests/machine.py), not speed checks.

One pytest run in a subprocess beside the load; the load stops itself after LOAD_S at the latest.
"""
import os
import subprocess
import sys

import pytest

from tests.machine import busy_cpu, dump_stacks_after, guard

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 processes importing torch in all: 2-3 minutes beside the load on 2 cores that other jobs share
# too (with the 3 s rendezvous test of test_launchers.py as well: 6.5 minutes at load 20)
TIGHTEST = [
    # a rank dies mid-step: the job must end, with the rank named, well before its timeout
    "tests/test_launch.py::test_rank_killed_mid_step_ends_job_with_clear_error",
    # a 2 s rendezvous wait, nobody listening: one line, exit 2
    "tests/test_faults.py::test_a_world_size_with_nobody_listening_fails_fast_in_one_message",
]
LOAD_S = 600  # the load's own end, should this test be killed before it stops the load
VERDICTS = ("PASSED ", "FAILED ", "ERROR ", "SKIPPED ")


@pytest.mark.launches
def test_the_tightest_time_limits_pass_with_the_cpu_oversubscribed(tmp_path, request):
    # TEST_TIMES_JSON: these seconds are no timing of the files, kept out of build/test-times.json
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
           "TEST_TIMES_JSON": str(tmp_path / "test-times.json")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *TIGHTEST]
    # its own load slows it: pytest's stack dump (faulthandler_timeout) waits for that too
    dump_stacks_after(request.config, guard(300) * 2)
    with busy_cpu(LOAD_S, per_core=2) as load:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=guard(600))
        running = sum(p.poll() is None for p in load)
    assert running == 2 * os.cpu_count(), "the load ended before the tests did"
    verdicts = sorted(line.split()[1] for line in proc.stdout.splitlines()
                      if line.startswith(VERDICTS))
    assert proc.returncode == 0 and verdicts == sorted(TIGHTEST), \
        proc.stdout[-4000:] + proc.stderr[-2000:]
