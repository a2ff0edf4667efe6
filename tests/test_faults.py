"""Faults in a job started by hand (mpirun, torchrun, plain python): one clear message, once, the documented
exit code (2: the input, 124: the watchdog), no Python traceback, and nothing left behind (no process, no
`minizero-job-*` directory in a private TMPDIR, no offload directory).

The multi-rank tests start real mpirun/torchrun jobs of tests/fault_script.py (cheap: one all-reduce).
"""
import errno
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from minizero import launch
from minizero.zero import infinity
from tests.machine import free_port, guard

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(cmd, tmp_path, timeout=240, **extra):
    """Run `cmd` with a private TMPDIR; return (exit code, stdout + stderr, what is left in TMPDIR, live pids)."""
    scratch, job = tmp_path / "tmp", uuid.uuid4().hex[:12]
    scratch.mkdir()
    env = dict(os.environ)
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "MINIZERO_HEARTBEAT_DIR"):
        env.pop(v, None)  # the test process's own launcher (if any) is not the job's
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TMPDIR=str(scratch), MINIZERO_JOB_ID=job, **extra)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=guard(timeout))
        deadline = time.monotonic() + 5  # the reaper removes the job directory once the last rank is gone
        while time.monotonic() < deadline and (launch.job_pids(job) or any(scratch.iterdir())):
            time.sleep(0.1)
        return proc.returncode, out + err, sorted(p.name for p in scratch.iterdir()), launch.job_pids(job)
    finally:
        for pid in launch.job_pids(job):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _mpirun(n, *args):
    return [launch.find_mpirun(), "-n", str(n), sys.executable, *args]


@pytest.mark.parametrize("n", [4, 8])
def test_watchdog_at_4_and_8_ranks_says_it_once(n, tmp_path):
    """Every rank but the stopped one sees no progress at about the same time: one message (there were 1-2
    FileNotFoundError tracebacks at 4 ranks, from ranks that looked for the job directory the first had removed)."""
    code, text, left, pids = _job(_mpirun(n, "tests/fault_script.py", "stop"), tmp_path, MINIZERO_WATCHDOG_S="2")
    assert code == 124, text[-3000:]
    assert text.count("[minizero watchdog] no progress for 2s") == 1, text[-3000:]
    assert "rank 1 " in text and "STOPPED" in text and f"rank {n - 1} in all_reduce" in text, text[-3000:]
    assert "Traceback" not in text and "Error" not in text and "Abort(" not in text, text[-3000:]
    assert left == [] and pids == [], (left, pids)


def test_every_rank_failing_exits_2_without_mpich_banner(tmp_path):
    """At 8 ranks, each rank os._exit(2)-ing let mpiexec SIGKILL ranks still exiting: 'EXIT CODE: 9' in 7 of
    12 runs of the same exits in a bare mpi4py script; now every rank leaves through MPI_Finalize."""
    code, text, left, pids = _job(_mpirun(8, "tests/fault_script.py", "fail_all"), tmp_path)
    assert code == 2, text[-3000:]
    assert text.count("the input is bad") == 1 and "BAD TERMINATION" not in text and "Traceback" not in text, text
    assert left == [] and pids == [], (left, pids)


@pytest.mark.parametrize("mode", ["bad_config", "bad_config_later"])
def test_a_bad_config_in_a_users_own_job_is_one_line_and_exit_2(mode, tmp_path):
    """mpirun running the user's script, minizero.initialize with zero_optimization.stage 5: every rank finds it,
    so the message is said once, naming the key, and the job exits 2 without a traceback per rank (before the
    script started the communicator, and after)."""
    code, text, left, pids = _job(_mpirun(2, "tests/fault_script.py", mode), tmp_path)
    assert code == 2, text[-3000:]
    said = [line for line in text.splitlines() if "zero_optimization.stage" in line]
    assert len(said) == 1 and said[0].startswith("minizero.initialize: "), text[-3000:]
    assert "Traceback" not in text and "BAD TERMINATION" not in text, text[-3000:]
    assert [x for x in left if x.startswith("minizero")] == [] and pids == [], (left, pids)


def test_a_killed_rank_is_named_and_leaves_no_job_directory(tmp_path):
    """kill -9 of rank 1: mpiexec's banner names rank 0's PID and exits 9 (its own; no rank runs any code after
    mpiexec's SIGKILL); the reaper (comm/reaper.py) names rank 1 and removes the job directory."""
    code, text, left, pids = _job(_mpirun(4, "tests/fault_script.py", "kill"), tmp_path)
    assert code == 9, text[-3000:]
    said = [line for line in text.splitlines() if "ended without a Python traceback" in line]
    assert len(said) == 1 and said[0].startswith("minizero: rank 1 (pid "), text[-3000:]
    assert "never stopped" not in text and "Traceback" not in text, text[-3000:]
    assert left == [] and pids == [], (left, pids)


def test_a_killed_rank_in_a_script_started_by_initialize_is_named(tmp_path):
    """A user's own script (its entry point minizero.initialize, not `minizero train`), rank 1 SIGKILLed: only
    MPICH's banner was printed (no watchdog or reaper ran there). initialize now starts them."""
    code, text, left, pids = _job(_mpirun(2, "tests/fault_script.py", "engine"), tmp_path)
    assert code == 9, text[-3000:]
    said = [line for line in text.splitlines() if "ended without a Python traceback" in line]
    assert len(said) == 1 and said[0].startswith("minizero: rank 1 (pid "), text[-3000:]
    assert [x for x in left if x.startswith("minizero")] == [] and pids == [], (left, pids)  # (torch's own
    # torchinductor_* cache is torch's)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _waiting_on_pidfds(pid: int) -> int:
    """How many pidfds process `pid` holds while it sleeps (0 while it runs): the reaper's wait."""
    if _state(pid) != "S":
        return 0
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return links.count("anon_inode:[pidfd]")


def _reap(tmp_path, order, beats=None):
    """Three ranks end in `order` while the reaper is stopped (as on a loaded machine it may
    run only after all have ended); `beats` {rank: heartbeat}; what it said, and the ranks' pids."""
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(3)]
    job = tmp_path / "job"
    job.mkdir()
    for rank, text in (beats or {}).items():
        (job / f"rank{rank}.op").write_text(text)
    reaper = subprocess.Popen([sys.executable, os.path.join(ROOT, "minizero", "comm", "reaper.py"), str(job),
                               *[str(p.pid) for p in ranks]], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + guard(30)
        while _waiting_on_pidfds(reaper.pid) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _waiting_on_pidfds(reaper.pid) == 3, "the reaper never waited on the 3 ranks"
        reaper.send_signal(signal.SIGSTOP)
        while _state(reaper.pid) != "T" and time.monotonic() < deadline:  # stopped, not stopping
            time.sleep(0.02)
        for rank in order:
            ranks[rank].kill()
            ranks[rank].wait()
        reaper.send_signal(signal.SIGCONT)
        _, err = reaper.communicate(timeout=guard(30))
    finally:
        for p in [*ranks, reaper]:
            if p.poll() is None:
                p.kill()
    assert not job.exists()
    return [line for line in err.splitlines() if "ended without a Python traceback" in line], ranks


def test_a_reaper_that_wakes_late_names_the_rank_that_ended_first(tmp_path):
    """A reaper that wakes after every rank has ended names the first to end, not the lowest rank
    (ranks ready together, sorted by rank, would name rank 0)."""
    said, ranks = _reap(tmp_path, (2, 0, 1))
    assert len(said) == 1 and said[0].startswith(f"minizero: rank 2 (pid {ranks[2].pid})"), said


def test_the_reaper_names_the_rank_the_others_waited_for(tmp_path):
    """mpiexec kills the others when the killed rank's socket closes, while that rank is still
    ending: rank 0, waiting in the all_reduce rank 1 never joined, can end first. The rank not
    waiting in a collective is named."""
    beats = {0: "all_reduce (40 B) on world", 1: "idle (last: all_reduce (40 B) on world)",
             2: "all_reduce (40 B) on world"}
    said, ranks = _reap(tmp_path, (0, 2, 1), beats)
    assert len(said) == 1 and said[0].startswith(f"minizero: rank 1 (pid {ranks[1].pid})"), said
    assert "in its own code" in said[0]


def test_a_killed_reaper_leaves_no_job_directory(tmp_path):
    """The reaper (the job's helper process) killed: the job ends normally and rank 0 removes the job directory
    the reaper would have (it stayed behind)."""
    code, text, left, pids = _job(_mpirun(2, "tests/fault_script.py", "reaper"), tmp_path)
    assert code == 0 and text.count("was never stopped") == 2, text[-3000:]
    assert left == [] and pids == [], (left, pids)


@pytest.mark.parametrize("mode", ["kill", "plain"])
def test_a_killed_rank_under_torchrun_is_one_line_not_the_survivors_traceback(mode, tmp_path):
    """torchrun, rank 1 SIGKILLed mid-job: the survivor's gloo error ('Connection reset by peer') was a raw
    traceback of its own code. Now: with a job reaper (train, labs) the reaper's line names rank 1; in a plain
    script the survivor says it in one line. torchrun's own ChildFailedError report follows (it cannot be
    suppressed by a child: comm/watchdog.py), and exits 1."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port())]
    code, text, left, pids = _job([*cmd, "tests/fault_script.py", mode], tmp_path)
    assert code == 1 and "ChildFailedError" in text, text[-3000:]
    want = "minizero: rank 1 (pid " if mode == "kill" else "minizero: rank 0: a peer rank ended during all_reduce"
    assert [line.startswith(want) for line in text.splitlines() if line.startswith("minizero")] == [True], text
    assert "[rank0]: Traceback" not in text and "never stopped" not in text, text[-3000:]
    assert [x for x in left if x.startswith("minizero-job-")] == [] and pids == [], (left, pids)  # (and torchrun's
    # own torchelastic_* directory is torchrun's)


def test_lab_10_on_3_ranks_is_one_line(tmp_path):
    """64 vocabulary rows over 3 tensor-parallel ranks: one line saying so and the size to run, exit 2."""
    code, text, left, _ = _job(_mpirun(3, "solutions/lab10_tensor_parallel.py"), tmp_path)
    assert code == 2, text[-3000:]
    said = [line for line in text.splitlines() if "is not divisible by the tensor-parallel size 3" in line]
    assert len(said) == 1 and said[0].startswith("lab 10 on 3 ranks: ") and "mpirun -n 4 python" in said[0], text
    assert "Traceback" not in text and left == [], text[-3000:]


def test_a_world_size_with_nobody_listening_fails_fast_in_one_message(tmp_path):
    """RANK=1 WORLD_SIZE=2 and no rank 0: torch's client retried for twice the timeout and printed two C++
    stack dumps (134 s at the default 60 s); now it waits the timeout once, quietly."""
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    train = [sys.executable, "-m", "minizero", "train", "--config", "configs/zero0_fp32.json", "--model", "mlp",
             "--steps", "1", "--out", str(tmp_path / "run")]
    code, text, _, _ = _job(train, tmp_path, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            MINIZERO_INIT_TIMEOUT_S="2")
    took = time.monotonic() - t0
    assert code == 2, text[-3000:]
    lines = text.strip().splitlines()
    assert len(lines) == 1 and f"rank 1 of 2: the torch.distributed rendezvous at MASTER_ADDR=127.0.0.1 " \
        f"MASTER_PORT={port} did not complete within 2 s (nothing listens at 127.0.0.1:{port}" in lines[0], text[-3000:]
    assert "frame #" not in text and "Traceback" not in text
    assert took < guard(150), took  # start-up (import torch: tens of seconds when loaded) + 2 s


@pytest.mark.parametrize("where", ["nvme_path", "param_nvme_path"])
def test_a_failed_nvme_offload_leaves_no_directory(where, tmp_path):
    """The disk full at the first write of the masters, or a parameter path that cannot be a directory: the
    DiskError, and nvme_path holds nothing (the empty minizero-rank0-* folders stayed until interpreter exit)."""
    nvme, blocker = tmp_path / "nvme", tmp_path / "a_file"
    nvme.mkdir()
    blocker.write_text("x")
    params = [torch.nn.Parameter(torch.ones(10))]

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")
    infinity._write_hook = full if where == "nvme_path" else None
    try:
        with pytest.raises(infinity.DiskError, match="disk is full" if where == "nvme_path" else "not a writable"):
            infinity.DiskOptimizer(params, torch.optim.SGD, str(nvme), 4, lr=0.1,
                                   param_nvme_path=None if where == "nvme_path" else str(blocker / "p"))
    finally:
        infinity._write_hook = None
    assert list(nvme.iterdir()) == []
