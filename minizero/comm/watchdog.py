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
Exit codes: 2 the input, 1 a bug, 124 the watchdog. Under mpirun, ranks that all failed leave
through MPI_Finalize and a normal exit, so mpiexec exits 2 with no banner; a rank killed by a signal
(kill -9, the OOM killer) runs no code, so mpiexec prints its "BAD TERMINATION ... EXIT CODE: 9"
banner (naming rank 0's PID) and exits 9, and comm/reaper.py, started by rank 0 outside the
launcher's reach, says which rank died and removes the job directory. torchrun reports any child
that exits non-zero with its own ChildFailedError (a traceback of torchrun's code, then a table of
each rank's exit code) and exits 1: that block follows minizero's one message and no child can
suppress it (exiting 0 would hide the failure).

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

from minizero import env as mz_env
from minizero.comm.backends import RankLost, describe_ranks, heartbeat, reaper_running
from minizero.comm.launcher import launcher
from minizero.comm.reaper import gone

DEFAULT_S = mz_env.VARIABLES["MINIZERO_WATCHDOG_S"].default
TIMEOUT_CODE = 124  # `timeout`'s exit code: the job ran out of time


def job_directory(comm) -> str:
    """The directory of this job's heartbeat files (all ranks call it: it may all-gather its
    name)."""
    if heartbeat.directory is None:  # not under launch.run: rank 0 makes one, removes it at exit
        import atexit
        mine = tempfile.mkdtemp(prefix="minizero-job-") if comm.rank == 0 else None
        places = comm.allgather_object((mine, os.getpid()))
        heartbeat.open(comm.rank, places[0][0])
        if comm.rank == 0:
            pids = [pid for _, pid in places]
            _start_reaper(pids)
            atexit.register(_remove_unless_reaper, pids)
        atexit.register(_mark, f"rank{comm.rank}.done")  # a normal exit, or an uncaught exception's
    return heartbeat.directory


_reaper = None  # rank 0's reaper process (comm/reaper.py), kept so that it is not garbage-collected


def _start_reaper(pids: list[int]):
    """Start comm/reaper.py in its own session: it names a rank killed without a word and removes
    the job directory once every rank has ended, also when a launcher SIGKILLs them all."""
    global _reaper
    import subprocess
    try:
        _reaper = subprocess.Popen(
            [
                sys.executable,
                os.path.join(os.path.dirname(__file__), "reaper.py"),
                heartbeat.directory,
                *map(str, pids),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:  # no process to spare: rank 0 removes the directory at its exit instead
        _reaper = None


def _remove_unless_reaper(pids: list[int], wait_s: float = 5.0):
    """At rank 0's exit: the reaper removes the job directory once every rank has ended; with no
    reaper (none could start, or it was killed) rank 0 removes it, so it never outlives the job.
    It waits (at most `wait_s`) for the other ranks' done marks or ends first: a rank that writes
    its mark while rmtree runs would leave the directory behind, not empty."""
    if _reaper is not None and _reaper.poll() is None:
        return
    directory, end = heartbeat.directory, time.monotonic() + wait_s
    while time.monotonic() < end and not all(
            gone(pid) or os.path.exists(os.path.join(directory, f"rank{r}.done"))
            for r, pid in enumerate(pids)):
        time.sleep(0.05)
    shutil.rmtree(directory, ignore_errors=True)


def _first(name: str) -> bool:
    """True for the first rank of the job to claim `name` (an exclusive file create)."""
    try:
        os.close(os.open(os.path.join(heartbeat.directory, name),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    # FileExistsError: claimed; FileNotFoundError: the rank ending the job removed the directory
    except OSError:
        return False


def _mark(name: str):
    """Write the empty file `name` in the job directory (nothing if the ending rank already removed
    it)."""
    try:
        open(os.path.join(heartbeat.directory, name), "w").close()
    except OSError:
        pass


def _ours() -> bool:
    """The job directory is the one job_directory() made, not launch.run's
    (MINIZERO_HEARTBEAT_DIR)."""
    return bool(heartbeat.directory) and not mz_env.is_set("MINIZERO_HEARTBEAT_DIR")


def _remove_directory():
    """Remove the job directory job_directory() made (its atexit never runs after os._exit or an
    abort). Renamed first, atomically, then removed: rmtree unlinks the claim files (watchdog.fired,
    failed) before the directory itself, and a rank whose watchdog fired in between claimed the name
    again in the half- removed directory and printed the job's message a second time (seen once in a
    CI run at 4 ranks)."""
    if _ours():
        going = f"{heartbeat.directory}.removed-{os.getpid()}"
        try:
            os.rename(heartbeat.directory, going)
        except OSError:  # another rank is removing it, or it is gone
            return
        shutil.rmtree(going, ignore_errors=True)


def _failed() -> bool:
    """A rank of the job is in end_job (it printed the job's message and ends the job)."""
    return os.path.exists(os.path.join(heartbeat.directory, "failed"))


def _a_rank_is_gone(comm) -> bool:
    """Some rank's process (its rank<r>.pid) has ended, or is a zombie: the reaper saw it end."""
    for r in range(comm.size):
        try:
            with open(os.path.join(heartbeat.directory, f"rank{r}.pid")) as f:
                pid = int(f.read())
            with open(f"/proc/{pid}/stat") as st:
                if st.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True  # no such process (or the directory went with the job)
        except (OSError, ValueError, IndexError):
            pass
    return False


def _all_marked(comm, kind: str) -> bool:
    """Every rank has written its rank<r>.<kind> file."""
    return all(
        os.path.exists(os.path.join(heartbeat.directory, f"rank{r}.{kind}"))
        for r in range(comm.size)
    )


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
        # let mpiexec forward what this rank just printed: an abort can drop its output
        time.sleep(0.5)
        # mpiexec ends every rank (SIGKILL: a stopped one too); MPICH's own "Abort(2) on node 1 ..."
        # line goes to /dev/null: the job's message is out already, and it is said once
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        MPI.COMM_WORLD.Abort(code)
    for r, pid in pids:
        if r != comm.rank:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # gone already, or on another machine (its launcher ends it once we exit)
    os._exit(code)


def end_job(comm, message: str, code: int = 2, wait_s: float = 3.0):
    """This rank failed with `message`: printed once for the job, then the job ends (module
    docstring)."""
    if comm.size == 1 or heartbeat.directory is None:
        sys.stderr.write(message.rstrip() + "\n")
        sys.stderr.flush()
        sys.exit(code)
    lost = sys.exc_info()[1]
    # a peer died: its launcher ends the job, the reaper names the rank
    if isinstance(lost, RankLost):
        if not (reaper_running() and _a_rank_is_gone(comm)):
            sys.stderr.write(f"{lost}\n")
            sys.stderr.flush()
        _mark(f"rank{comm.rank}.done")  # not the silent death the reaper reports
        os._exit(code)
    if _first("failed"):
        sys.stderr.write(message.rstrip() + "\n")
        sys.stderr.flush()
    _mark(f"rank{comm.rank}.failed")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if _all_marked(comm, "failed"):  # every rank failed alike: nobody waits in a collective
            sys.stdout.flush()
            if launcher() == "mpi":
                _leave_mpi_together(comm, code)
            _mark(f"rank{comm.rank}.exiting")
            # rank 0 removes the files once every rank has seen the vote; the others wait for that
            # before they exit, since mpiexec kills the job's other ranks when one exits non-zero
            seen_deadline = time.monotonic() + 2.0
            if comm.rank == 0:
                while not _all_marked(comm, "exiting") and time.monotonic() < seen_deadline:
                    time.sleep(0.05)
                _remove_directory()
            while (
                _ours() and os.path.isdir(heartbeat.directory) and time.monotonic() < seen_deadline
            ):
                time.sleep(0.05)
            os._exit(code)
        time.sleep(0.05)
    _end(comm, code)


def _leave_mpi_together(comm, code: int):
    """Every rank failed alike, under mpiexec: all leave with `code`, and mpiexec says nothing more.

    mpiexec SIGKILLs the ranks still running once one has exited non-zero, and then reports 'BAD
    TERMINATION ... EXIT CODE: 9'. Measured in a bare mpi4py job at 8 ranks: every rank os._exit(2)
    after a barrier, 5 of 12 runs exit 9; the same after MPI_Finalize, 7 of 12; MPI_Finalize (it
    returns once every rank has called it: every rank is here) and then a normal exit, sys.exit(2),
    0 of 12 (and 0 of 20 at 4 and 8 ranks with torch imported)."""
    from mpi4py import MPI
    # a finalize that never returns (a request left
    guard = threading.Timer(30.0, os._exit, (code,))
    guard.daemon = True                                # pending by the failure) still ends the rank
    guard.start()
    MPI.Finalize()
    if comm.rank == 0:
        _remove_directory()  # every rank is past reading it: they all reached MPI_Finalize
    raise SystemExit(code)


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
        # a rank that failed, or another watchdog, ends the job
        if _failed() or not _first("watchdog.fired"):
            time.sleep(60)
            os._exit(TIMEOUT_CODE)
        ranks = describe_ranks(heartbeat.directory, self.comm.size, ages=True)
        sys.stderr.write(f"\n[minizero watchdog] no progress for {self.seconds:g}s: rank "
                         f"{self.comm.rank} has been blocked in {text}. Ending the job "
                         "(MINIZERO_WATCHDOG_S sets the limit). The ranks:\n"
                         + "".join(f"  rank {r} {desc}\n" for r, desc in ranks.items()))
        _end(self.comm, TIMEOUT_CODE)


_watching: dict = {}  # the world's Watchdog (or None: turned off), once per process


def start(comm, seconds: float | None = None) -> Watchdog | None:
    """Watch this rank's collectives (all ranks call it; a second call returns the first's
    watchdog). seconds: None -> MINIZERO_WATCHDOG_S or 300; 0 -> no watchdog (the job directory for
    end_job is set up either way)."""
    if "world" in _watching:
        return _watching["world"]
    job_directory(comm)
    seconds = mz_env.get("MINIZERO_WATCHDOG_S") if seconds is None else float(seconds)
    _watching["world"] = Watchdog(comm, seconds) if seconds > 0 else None
    return _watching["world"]
