"""The job's reaper: a rank killed without a word is named, and the job directory never outlives the
job.

A rank that gets SIGKILL (the OOM killer, `kill -9`) runs no Python: no message, no cleanup. mpiexec
then SIGKILLs every other rank (its banner names rank 0's PID, not the dead rank) and torchrun sends
them SIGTERM, so no rank of the job can say what happened or remove the job directory
(comm/watchdog.py's job_directory). This small process, started by rank 0 in its own session (a
launcher's kill of the job's processes does not reach it), waits for the ranks' processes to end
(pidfd_open and epoll: woken by the kernel the moment one exits, no polling). Of the ranks that end
without their `rank<r>.done` mark (written at a normal exit), while no rank has reported a failure
(`failed`, `watchdog.fired`) and the directory still exists, one is named (_name), with what its
heartbeat said it was doing. Once every rank is gone, the directory is removed.

Run as a file (`python reaper.py DIR PID0 PID1 ...`): standard library only, so it starts in tens of
milliseconds (importing minizero would import torch).
"""
from __future__ import annotations

import os
import select
import shutil
import sys
import time


def _ended_without_a_word(directory: str, rank: int) -> bool:
    """The rank ended with no normal exit and no failure of the job reported."""
    marks = (f"rank{rank}.done", "failed", "watchdog.fired")
    return os.path.isdir(directory) and not any(
        os.path.exists(os.path.join(directory, m)) for m in marks
    )


def _doing(directory: str, rank: int) -> str:
    """What the rank's heartbeat last said (comm/backends.py writes it around every collective)."""
    try:
        with open(os.path.join(directory, f"rank{rank}.op")) as f:
            text = f.read().strip()
    except OSError:
        text = ""
    if not text:
        return "before its first collective"
    return f"in its own code ({text})" if text.startswith("idle") else f"in {text}"


def _say(directory: str, rank: int, pid: int):
    message = (f"minizero: rank {rank} (pid {pid}) ended without a Python traceback "
               f"{_doing(directory, rank)}: it was killed (SIGKILL: the OOM killer, `kill -9`?). "
               "The launcher ends the other ranks.\n")
    try:
        sys.stderr.write(message)
        sys.stderr.flush()
    except OSError:
        pass  # the launcher's pipe is gone: nobody to tell


def gone(pid: int) -> bool:
    """No process, or a zombie (ended, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _blocked(directory: str, rank: int) -> bool:
    """The rank's heartbeat says it was waiting in a collective (for a peer), not in its code."""
    doing = _doing(directory, rank)
    return doing.startswith("in ") and not doing.startswith("in its own code")


def _name(directory: str, ended: list) -> None:
    """Name one of the ranks that ended without a word, in the order they ended: the first that was
    not waiting in a collective, else the first. The order alone cannot say it: mpiexec sees the
    killed rank's socket close while its process is still ending and kills the others, and one of
    them, waiting in the collective that the killed rank never joined, may end first."""
    if ended:
        rank, pid = next(((r, p) for r, p in ended if not _blocked(directory, r)), ended[0])
        _say(directory, rank, pid)


def watch(directory: str, pids: list[int], settle_s: float = 2.0):
    """Wait until every rank has ended; name the rank that ended without a word (_name, among
    those that ended within `settle_s` of the first); remove `directory`."""
    alive = dict(enumerate(pids))
    ended, first, told = [], None, False
    if hasattr(os, "pidfd_open"):
        # epoll hands back ready descriptors in the order they became ready, also when this
        # process wakes only after several ranks have ended
        fds, poller = {}, select.epoll()
        for rank, pid in list(alive.items()):
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # ended already
                fd = None
            if fd is None:
                if _ended_without_a_word(directory, rank):
                    ended.append((rank, pid))
            else:
                fds[fd] = rank
                poller.register(fd, select.EPOLLIN)
        while fds:
            if ended and first is None:
                first = time.monotonic()
            wait = -1 if first is None or told else max(0.0, first + settle_s - time.monotonic())
            events = poller.poll(wait)
            for fd, _ in events:
                rank = fds.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                if not told and _ended_without_a_word(directory, rank):
                    ended.append((rank, alive[rank]))
            if not told and first is not None and (not events or not fds):
                _name(directory, ended)
                told = True
        poller.close()
    else:  # pragma: no cover - Linux < 5.3: look ten times a second
        while alive:
            for rank, pid in sorted(alive.items()):
                if gone(pid):
                    alive.pop(rank)
                    if _ended_without_a_word(directory, rank):
                        ended.append((rank, pid))
            time.sleep(0.1)
    if not told:
        _name(directory, ended)
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    watch(sys.argv[1], [int(p) for p in sys.argv[2:]])
