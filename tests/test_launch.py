"""The launcher never hangs and always says what went wrong."""
import time

import pytest

from minizero import launch
from tests.machine import guard

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

W = "tests/comm_workers.py:"


def test_results_in_rank_order():
    assert launch.run(W + "raise_on_rank", nprocs=3, args={"rank": 99}, timeout=60) == [0, 1, 2]


def test_rank_error_carries_traceback():
    with pytest.raises(launch.RankError) as e:
        launch.run(W + "raise_on_rank", nprocs=3, args={"rank": 2}, timeout=60)
    assert e.value.rank == 2
    assert "KeyError: 'deliberate failure'" in e.value.rank_traceback
    assert "raise_on_rank" in e.value.rank_traceback


def test_timeout_names_collective_and_leaves_no_process(monkeypatch):
    job_ids = []
    real_uuid = launch.uuid.uuid4

    def spy():
        u = real_uuid()
        job_ids.append(u.hex[:12])
        return u
    monkeypatch.setattr(launch.uuid, "uuid4", spy)
    # 15 s: long enough for every rank to start and reach its collective, scaled on a busy machine
    # (tests/conftest.py); then the job ends at its timeout, not later
    t0 = time.time()
    with pytest.raises(launch.LaunchTimeout) as e:
        launch.run(W + "hang_in_collective", nprocs=3, timeout=15)
    assert e.value.timeout >= 15 and time.time() - t0 < e.value.timeout + guard(20)
    assert "all_gather" in e.value.where[1] and "all_gather" in e.value.where[2]
    assert "all_gather" not in e.value.where[0]
    assert "rank 1 in all_gather" in str(e.value)
    time.sleep(0.5)
    assert launch.job_pids(job_ids[-1]) == [], "processes of the timed-out job are still alive"


def test_missing_mpirun_says_how_to_get_it(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(launch.sys, "executable", "/nonexistent/python")
    with pytest.raises(launch.LaunchError, match="mpich"):
        launch.run(W + "report_pid", nprocs=2)


def test_world_size_it_cannot_get(monkeypatch):
    monkeypatch.setenv("MINIZERO_MAX_RANKS", "4")
    with pytest.raises(launch.LaunchError, match="at most 4"):
        launch.run(W + "report_pid", nprocs=6)
    with pytest.raises(launch.RankError, match="needs 4 ranks.*runs on 2"):
        launch.run(W + "needs_four", nprocs=2, timeout=60)


def test_bad_target():
    with pytest.raises(ValueError, match="module:function"):
        launch.run("no_colon", nprocs=1)
    with pytest.raises(FileNotFoundError):
        launch.run("missing_file.py:f", nprocs=1)


def test_rank_killed_mid_step_ends_job_with_clear_error(monkeypatch):
    job_ids = []
    real_uuid = launch.uuid.uuid4
    monkeypatch.setattr(launch.uuid, "uuid4", lambda: job_ids.append(real_uuid()) or job_ids[-1])
    t0 = time.time()
    with pytest.raises(launch.LaunchError) as e:
        launch.run(W + "die_mid_step", nprocs=3, args={"rank": 1}, timeout=60)
    assert time.time() - t0 < guard(30), "a dead rank must end the job, not wait for the timeout"
    assert not isinstance(e.value, launch.LaunchTimeout)
    msg = str(e.value)
    assert msg.startswith("rank 1 died without a Python traceback")
    assert "rank 0 in all_reduce" in msg and "rank 2 in all_reduce" in msg
    time.sleep(0.5)
    assert launch.job_pids(job_ids[-1].hex[:12]) == []


def test_the_timeout_scale_is_the_variable_or_the_load_per_core_within_1_to_20(monkeypatch):
    """MINIZERO_TIMEOUT_SCALE multiplies every launch's timeout: a number as given; load, the
    1-minute load average per core, never below 1 (an idle machine keeps the timeout as written)
    nor above 20 (a hang still ends)."""
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 2)
    for value, load, want in (("3", 50.0, 3.0), ("load", 9.0, 4.5), ("load", 0.3, 1.0),
                              ("load", 100.0, 20.0)):
        monkeypatch.setenv("MINIZERO_TIMEOUT_SCALE", value)
        monkeypatch.setattr(launch.os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert launch.timeout_scale() == want, (value, load)
