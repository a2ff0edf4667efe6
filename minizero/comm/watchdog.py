"""Ending a job started by hand, cleanly: the collective watchdog, and one message for a failure.

launch.run supervises its jobs from outside, with a timeout. A job started by hand has no such
supervisor (`mpirun -n 4 python -m minizero train ...`, `mpirun -n 4 python labs/lab04_zero1.py`,
`torchrun ...`), so two things are done from inside, by every rank:

  * The watchdog. One rank that stops (SIGSTOP, a debugger, a swap storm, an endless loop in its
    own code) leaves every other rank waiting in its next collective, forever. Every rank writes
    what it is in before and after each collective (the heartbeat of comm/backends.py, the very
    files launch.run reads), and a daemon thread on every rank watches its own: blocked in ONE
    collective for more than `seconds` (default 300, generous: a healthy collective here takes
    milliseconds; MINIZERO_WATCHDOG_S sets it, 0 turns it off) means the job is stuck. The first
    rank to see it prints what every rank was doing and for how long (a stopped process is named
    as such) and ends the job with exit code 124, as `timeout` does.
  * end_job(comm, message). A rank that fails prints the message only if it is the FIRST to fail
    (every rank of a config error fails alike: one message, not N tracebacks), then waits a few
    seconds for the others: all failed -> they all exit with the code; some still running -> they
    would wait in a collective forever, so the job is ended.
Ending the job leaves no process behind: MPI_Abort under mpirun (mpiexec kills every rank, a
stopped one too), SIGKILL to the other ranks on this machine under torchrun or a plain python.

The files live in a temporary directory rank 0 creates and every rank learns at start (one small
all-gather): ranks on ONE machine. Across machines, point MINIZERO_HEARTBEAT_DIR at a shared
directory. Under launch.run the job's own directory is used.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time

from minizero.comm.backends import describe_ranks, heartbeat

DEFAULT_S = 300.0
TIMEOUT_CODE = 124  # `timeout`'s exit code: the job ran out of time


def job_directory(comm) -> str:
    """The directory of this job's heartbeat files (all ranks call it: it may all-gather its name)."""
    if heartbeat.directory is None:  # not under launch.run: rank 0 makes one, removes it at exit
        mine = tempfile.mkdtemp(prefix="minizero-job-") if comm.rank == 0 else None
        heartbeat.open(comm.rank, comm.allgather_object(mine)[0])
        if comm.rank == 0:
            import atexit
            atexit.register(shutil.rmtree, heartbeat.directory, True)
    return heartbeat.directory


def _first(name: str) -> bool:
    """True for the first rank of the job to claim `name` (an exclusive file create)."""
    try:
        os.close(os.open(os.path.join(heartbeat.directory, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _ours() -> bool:
    """The job directory is the one job_directory() made, not launch.run's (MINIZERO_HEARTBEAT_DIR)."""
    return bool(heartbeat.directory) and "MINIZERO_HEARTBEAT_DIR" not in os.environ


def _remove_directory():
    """Remove the job directory job_directory() made (its atexit never runs after os._exit or an abort)."""
    if _ours():
        shutil.rmtree(heartbeat.directory, ignore_errors=True)


def _all_marked(comm, kind: str) -> bool:
    """Every rank has written its rank<r>.<kind> file."""
    return all(os.path.exists(os.path.join(heartbeat.directory, f"rank{r}.{kind}")) for r in range(comm.size))


def _end(comm, code: int):
    """End every rank of the job now, this one last."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for r in range(comm.size):
        try:
            with open(os.path.join(heartbeat.directory, f"rank{r}.pid")) as f:
                pids.append((r, int(f.read())))
        except (OSError, ValueError):
            pass
    _remove_directory()  # this rank ends the others: nobody reads the files any more
    if comm.backend == "mpi":
        from mpi4py import MPI
        time.sleep(0.5)  # let mpiexec forward what this rank just printed: an abort can drop its output
        MPI.COMM_WORLD.Abort(code)  # mpiexec ends every rank (SIGKILL: a stopped one too)
    for r, pid in pids:
        if r != comm.rank:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # gone already, or on another machine (its launcher ends it once we exit)
    os._exit(code)


def end_job(comm, message: str, code: int = 2, wait_s: float = 3.0):
    """This rank failed with `message`: printed once for the job, then the job ends (module docstring)."""
    if comm.size == 1 or heartbeat.directory is None:
        sys.stderr.write(message.rstrip() + "\n")
        sys.stderr.flush()
        sys.exit(code)
    if _first("failed"):
        sys.stderr.write(message.rstrip() + "\n")
        sys.stderr.flush()
    open(os.path.join(heartbeat.directory, f"rank{comm.rank}.failed"), "w").close()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if _all_marked(comm, "failed"):  # every rank failed alike: nobody waits in a collective
            sys.stdout.flush()
            try:
                open(os.path.join(heartbeat.directory, f"rank{comm.rank}.exiting"), "w").close()
            except OSError:
                pass  # rank 0 gave up waiting for this rank and removed the directory
            # rank 0 removes the files once every rank has seen the vote; the others wait for that
            # before they exit, since mpiexec kills the job's other ranks when one exits non-zero
            seen_deadline = time.monotonic() + 2.0
            if comm.rank == 0:
                while not _all_marked(comm, "exiting") and time.monotonic() < seen_deadline:
                    time.sleep(0.05)
                _remove_directory()
            while _ours() and os.path.isdir(heartbeat.directory) and time.monotonic() < seen_deadline:
                time.sleep(0.05)
            os._exit(code)
        time.sleep(0.05)
    _end(comm, code)


class Watchdog:
    def __init__(self, comm, seconds: float):
        self.comm = comm                      # the world: its size is the job's
        self.seconds = seconds                # a collective blocked this long ends the job
        self.poll = min(1.0, seconds / 4)     # how often the thread looks
        self.thread = threading.Thread(target=self._watch, name="minizero-watchdog", daemon=True)
        self.thread.start()

    def _watch(self):
        while True:
            time.sleep(self.poll)
            text, since = heartbeat.text, heartbeat.since
            if text and not text.startswith("idle") and time.monotonic() - since > self.seconds:
                self._fire(text)

    def _fire(self, text):
        if not _first("watchdog.fired"):  # another rank is ending the job
            time.sleep(60)
            os._exit(TIMEOUT_CODE)
        ranks = describe_ranks(heartbeat.directory, self.comm.size, ages=True)
        sys.stderr.write(f"\n[minizero watchdog] no progress for {self.seconds:g}s: rank {self.comm.rank} has been "
                         f"blocked in {text}. Ending the job (MINIZERO_WATCHDOG_S sets the limit). The ranks:\n"
                         + "".join(f"  rank {r} {desc}\n" for r, desc in ranks.items()))
        _end(self.comm, TIMEOUT_CODE)


def start(comm, seconds: float | None = None) -> Watchdog | None:
    """Watch this rank's collectives (all ranks call it). seconds: None -> MINIZERO_WATCHDOG_S or
    300; 0 -> no watchdog (the job directory for end_job is set up either way)."""
    job_directory(comm)
    seconds = float(os.environ.get("MINIZERO_WATCHDOG_S", DEFAULT_S)) if seconds is None else float(seconds)
    return Watchdog(comm, seconds) if seconds > 0 else None
