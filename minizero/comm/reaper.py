"""The job's reaper: a rank killed without a word is named, and the job directory never outlives the
job.

A rank that gets SIGKILL (the OOM killer, `kill -9`) runs no Python: no message, no cleanup. mpiexec
then SIGKILLs every other rank (its banner names rank 0's PID, not the dead rank) and torchrun sends
them SIGTERM, so no rank of the job can say what happened or remove the job directory
(comm/watchdog.py's job_directory). This small process, started by rank 0 in its own session (a
launcher's kill of the job's processes does not reach it), waits for the ranks' processes to end
(pidfd_open and epoll: woken by the kernel the moment one exits, no polling). The first rank that
ends without its `rank<r>.done` mark (written at a normal exit), while no rank has reported a
failure (`failed`, `watchdog.fired`) and the directory still exists, is named, with what its
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


def _gone(pid: int) -> bool:
    """No process, or a zombie (ended, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def watch(directory: str, pids: list[int]):
    """Wait until every rank has ended; name the first that ended without a word; remove
    `directory`."""
    alive = dict(enumerate(pids))
    told = False
    if hasattr(os, "pidfd_open"):
        # epoll hands back ready descriptors in the order they became ready: on a loaded machine
        # this process may wake only after the launcher has killed the other ranks too, and then
        # the first in that list is still the rank that ended first.
        fds, poller = {}, select.epoll()
        for rank, pid in list(alive.items()):
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # ended already
                fd = None
            if fd is None:
                alive.pop(rank)
                if not told and _ended_without_a_word(directory, rank):
                    _say(directory, rank, pid)
                    told = True
            else:
                fds[fd] = rank
                poller.register(fd, select.EPOLLIN)
        while fds:
            for fd, _ in poller.poll():
                rank = fds.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                if not told and _ended_without_a_word(directory, rank):
                    _say(directory, rank, alive[rank])
                    told = True
        poller.close()
    else:  # pragma: no cover - Linux < 5.3: look ten times a second
        while alive:
            for rank, pid in sorted(alive.items()):
                if _gone(pid):
                    alive.pop(rank)
                    if not told and _ended_without_a_word(directory, rank):
                        _say(directory, rank, pid)
                        told = True
            time.sleep(0.1)
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    watch(sys.argv[1], [int(p) for p in sys.argv[2:]])
