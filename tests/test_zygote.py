"""minizero/zygote.py: ranks forked from one process that imported torch give launch.run what
ranks started cold give (results, bytes, errors, timeouts), and nothing of a job outlives it."""
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from minizero import launch
from tests.machine import guard

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

W = "tests/comm_workers.py:"


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture
def zygote(monkeypatch):
    monkeypatch.setenv("MINIZERO_ZYGOTE", "1")
    launch.run(W + "report_pid", nprocs=1, timeout=120)  # started here: its import is not timed
    proc = launch._ZYGOTE["proc"]
    assert proc.poll() is None and os.path.exists(launch._ZYGOTE["path"])
    return proc


def test_forked_ranks_measure_what_cold_ranks_do(zygote, monkeypatch):
    assert launch.run(W + "report_parent", nprocs=3, timeout=60) == [zygote.pid] * 3
    warm = launch.run(W + "every_collective", nprocs=3, timeout=120)
    t0 = time.time()
    launch.run(W + "raise_on_rank", nprocs=4, args={"rank": 99}, timeout=60)
    warm_start_s = time.time() - t0
    monkeypatch.setenv("MINIZERO_ZYGOTE", "0")
    cold = launch.run(W + "every_collective", nprocs=3, timeout=120)
    assert [r["bad"] for r in warm] == [[], [], []]
    assert [r["stats"] for r in warm] == [r["stats"] for r in cold]
    assert [r["sent"] for r in warm] == pytest.approx([r["expected_sent"] for r in warm])
    t0 = time.time()
    launch.run(W + "raise_on_rank", nprocs=4, args={"rank": 99}, timeout=60)
    cold_start_s = time.time() - t0
    # no speed verdict (other jobs share the machine): the figures go to the log
    print(f"a 4-rank job with a barrier: {warm_start_s:.2f} s forked, {cold_start_s:.2f} s cold")


def test_a_forked_rank_that_raises_or_is_killed_is_named(zygote):
    with pytest.raises(launch.RankError) as e:
        launch.run(W + "raise_on_rank", nprocs=3, args={"rank": 2}, timeout=60)
    assert e.value.rank == 2 and "KeyError: 'deliberate failure'" in e.value.rank_traceback
    with pytest.raises(launch.LaunchError, match="rank 1 died without a Python traceback"):
        launch.run(W + "die_mid_step", nprocs=3, args={"rank": 1}, timeout=60)
    time.sleep(0.5)
    assert _children(zygote.pid) == [], "ranks of the failed jobs outlived them"
    assert launch.run(W + "report_parent", nprocs=2, timeout=60) == [zygote.pid] * 2


def test_a_timed_out_job_leaves_no_forked_rank(zygote, monkeypatch):
    job_ids, real_uuid = [], launch.uuid.uuid4

    def spy():
        job_ids.append(real_uuid().hex[:12])
        return uuid.UUID(hex=job_ids[-1] + "0" * 20)
    monkeypatch.setattr(launch.uuid, "uuid4", spy)
    seen, errors = [], []

    def job():
        try:
            launch.run(W + "hang_in_collective", nprocs=3, timeout=15)
        except launch.LaunchTimeout as e:
            errors.append(e)
    thread = threading.Thread(target=job)
    thread.start()
    deadline = time.time() + guard(15)
    while len(seen) < 3 and time.time() < deadline:  # job_pids finds the forks while they run
        seen = [p for p in (launch.job_pids(job_ids[0]) if job_ids else []) if p in
                _children(zygote.pid)]
        time.sleep(0.2)
    thread.join(guard(60))
    assert len(seen) == 3, f"launch.job_pids found {len(seen)} of the job's 3 forked ranks"
    assert errors, "the hung job did not time out"
    assert "all_gather" in errors[0].where[1] and "all_gather" not in errors[0].where[0]
    deadline = time.time() + guard(5)  # the zygote reaps its killed forks within 50 ms
    while launch.job_pids(job_ids[0]) and time.time() < deadline:
        time.sleep(0.1)
    assert launch.job_pids(job_ids[0]) == []
    deadline = time.time() + guard(5)
    while _children(zygote.pid) and time.time() < deadline:
        time.sleep(0.1)
    assert _children(zygote.pid) == [], "the zygote kept the ranks of a job mpirun had ended"


SCRIPT = """
import atexit, json, os, sys
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
out = sys.argv[1]
atexit.register(lambda: open(os.path.join(out, f"exit{rank}"), "w").close())
print(json.dumps({"rank": rank, "ppid": os.getppid(), "name": __name__, "argv": sys.argv[1:],
                  "path0": sys.path[0]}), flush=True)
MPI.COMM_WORLD.Barrier()
if sys.argv[2:] == ["fail"]:
    sys.exit(f"rank {rank} says why")
"""


def test_a_script_forked_under_mpirun_runs_as_python_runs_it(zygote, tmp_path):
    """`mpirun -n N python zygote.py script FILE ARGS`: each rank a fork, with what `python FILE ARGS`
    gives it (__main__, sys.argv, the file's folder first on sys.path, its exit handlers run, and
    sys.exit("message") printed with code 1)."""
    script, out = tmp_path / "job" / "script.py", tmp_path / "out"
    script.parent.mkdir()
    out.mkdir()
    script.write_text(SCRIPT)
    env = {**os.environ, launch.zygote.SOCKET_VAR: launch._ZYGOTE["path"]}

    def forked(n, *args):
        return subprocess.run([launch.find_mpirun(), "-n", str(n), sys.executable, launch.zygote.__file__,
                               "script", str(script), str(out), *args], capture_output=True, text=True,
                              env=env, timeout=guard(120))
    ok = forked(2)
    assert ok.returncode == 0, ok.stderr[-2000:]
    ranks = sorted((json.loads(line) for line in ok.stdout.splitlines()), key=lambda r: r["rank"])
    assert [r["ppid"] for r in ranks] == [zygote.pid] * 2
    assert {(r["name"], tuple(r["argv"]), r["path0"]) for r in ranks} == {
        ("__main__", (str(out),), str(script.parent))}
    assert sorted(p.name for p in out.iterdir()) == ["exit0", "exit1"]
    failed = forked(1, "fail")
    assert failed.returncode == 1 and failed.stderr.count("rank 0 says why") == 1, failed.stderr[-2000:]


def test_without_a_zygote_the_stub_is_the_rank(monkeypatch):
    monkeypatch.setenv("MINIZERO_ZYGOTE", "1")
    monkeypatch.setattr(launch, "_zygote_socket", lambda env: "/nonexistent/socket")
    parents = launch.run(W + "report_parent", nprocs=2, timeout=60)
    zygote = launch._ZYGOTE.get("proc")
    assert len(set(parents)) == 1 and (zygote is None or zygote.pid not in parents)  # the proxy


def test_the_zygote_ends_with_the_process_that_started_it():
    code = ("import os; from minizero import launch; os.environ['MINIZERO_ZYGOTE'] = '1'; "
            "launch.run('tests/comm_workers.py:report_pid', nprocs=1, timeout=120); "
            "print(launch._ZYGOTE['proc'].pid)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=guard(180), env={**_without_a_shared_zygote(), "MINIZERO_ZYGOTE": "0"})
    pid = int(out.stdout.split()[-1])
    deadline = time.time() + guard(10)
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the zygote outlived the process that started it"


def _without_a_shared_zygote() -> dict:
    return {k: v for k, v in os.environ.items() if k != launch.zygote.SOCKET_VAR}


def test_a_process_started_after_share_zygote_forks_its_ranks_from_that_zygote(monkeypatch):
    monkeypatch.setenv("MINIZERO_ZYGOTE", "1")
    path = launch.share_zygote()
    assert path and os.environ[launch.zygote.SOCKET_VAR] == path
    code = ("import json; from minizero import launch; "
            "print(json.dumps([launch.run('tests/comm_workers.py:report_parent', nprocs=2, "
            "timeout=120), 'proc' in launch._ZYGOTE]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=guard(180))
    parents, started_its_own = json.loads(out.stdout.splitlines()[-1])
    assert parents == [launch._ZYGOTE["proc"].pid] * 2 and not started_its_own
    # without the variable the same program starts a zygote of its own
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=guard(180), env=_without_a_shared_zygote())
    parents, started_its_own = json.loads(out.stdout.splitlines()[-1])
    assert launch._ZYGOTE["proc"].pid not in parents and started_its_own


def test_a_zygote_of_another_python_is_not_shared(tmp_path):
    sock = tmp_path / "socket"
    assert not launch._serves_this_python(str(sock))  # nothing there
    sock.write_text("")
    (tmp_path / "socket.python").write_text("/other/venv/bin/python")
    assert not launch._serves_this_python(str(sock))
    (tmp_path / "socket.python").write_text(sys.executable)
    assert launch._serves_this_python(str(sock))
    os.unlink(sock)  # the zygote ended: its socket is gone
    assert not launch._serves_this_python(str(sock))


def test_on_by_default_only_without_an_nvidia_gpu(monkeypatch):
    monkeypatch.delenv("MINIZERO_ZYGOTE", raising=False)
    exists = os.path.exists
    for gpu in (False, True):
        monkeypatch.setattr(launch.os.path, "exists",
                            lambda p, gpu=gpu: gpu if p == "/dev/nvidiactl" else exists(p))
        assert launch._use_zygote({}) is (not gpu)
        assert launch._use_zygote({"MINIZERO_ZYGOTE": "0"}) is False
        assert launch._use_zygote({"MINIZERO_ZYGOTE": "1"}) is True
