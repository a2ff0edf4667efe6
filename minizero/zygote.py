"""A warm parent for launch.run's ranks: torch imported once, each rank forked from it.

A rank's first seconds on CPU are `import torch` (about 2-4 s of one core here), paid again by
every rank of every launch: on 2 cores a 4-rank job spent 7-9 s from launch.run to its result, a
lesson or a test with several launches most of its time. So launch.run starts this process once
per caller (or uses the one a parent shared: launch.share_zygote): it imports torch and waits on a
Unix socket.
mpirun still starts every rank, as `python minizero/zygote.py stub ...`, a process that imports
nothing heavy; the stub hands the zygote its environment, working folder and file descriptors
(stdin, stdout, stderr and mpirun's PMI socket, the one MPI_Init talks to) and the zygote forks a
child that *is* the rank: it calls MPI_Init over that socket, so mpirun and MPI see the same N ranks
as before, and it runs `minizero.launch` as `python -m` would. The stub waits and exits as its child
did, with its code or its signal; if the stub dies (mpirun killing the job), the zygote kills the
child. Measured: the same 4-rank job in 1.2-1.4 s.

`python zygote.py script FILE ARGS` under mpirun forks a user's script the same way (its exit
handlers run, as Python's exit would run them): the tests run the labs' demos so.

Nothing of minizero is imported before the fork, so every rank runs the code as it is on disk.
Android starts its apps the same way (its process is called the zygote). MINIZERO_ZYGOTE turns it
on or off (minizero/env.py: unset, on where no NVIDIA GPU is); when the socket cannot be reached
the stub runs the rank itself, as without it.
"""
from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys

SOCKET_VAR = "MINIZERO_ZYGOTE_SOCKET"  # set by launch.run for its ranks: where the zygote listens
_MAX_FDS = 4


def _send(conn: socket.socket, message: dict, fds=()) -> None:
    data = json.dumps(message).encode()
    header = struct.pack("!I", len(data))
    if fds:
        rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))
        conn.sendmsg([header + data], [rights])
    else:
        conn.sendall(header + data)


def _recv(conn: socket.socket):
    """(message, fds) or (None, []) when the other side closed."""
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(4, socket.CMSG_LEN(_MAX_FDS * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if len(data) < 4:
        return None, list(fds)
    (n,) = struct.unpack("!I", data)
    body = b""
    while len(body) < n:
        chunk = conn.recv(n - len(body))
        if not chunk:
            return None, list(fds)
        body += chunk
    return json.loads(body), list(fds)


# ------------------------------------------------------------------------------- the rank's stub
def stub(run: dict) -> None:
    """What mpirun starts: hand this rank to the zygote, wait for it, exit as it did. `run` is
    {"module": name, "argv": [...]} (`python -m name ...`) or {"path": file, "argv": [file, ...]}
    (`python file ...`)."""
    path = os.environ.get(SOCKET_VAR, "")
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
    except OSError:  # no zygote: be the rank ourselves
        python = [sys.executable] + (["-m", run["module"]] if "module" in run else [])
        os.execv(sys.executable, python + run["argv"])
    fds = [0, 1, 2]
    if os.environ.get("PMI_FD", "").isdigit():
        fds.append(int(os.environ["PMI_FD"]))
    _send(conn, {"env": dict(os.environ), "cwd": os.getcwd(), **run}, fds)
    status, _ = _recv(conn)  # {"pid": ...}, then how it ended
    while status is not None and "pid" in status:
        status, _ = _recv(conn)
    if status is None:
        os._exit(1)
    if status.get("signal"):
        signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
    os._exit(status.get("code", 1))


# ------------------------------------------------------------------------------ the forked rank
def _become_rank(request: dict, fds: list) -> None:
    """In the forked child: take the stub's descriptors and environment, then run the rank."""
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    for i, fd in enumerate(fds[:3]):
        os.dup2(fd, i)
    env = dict(request["env"])
    if len(fds) > 3:
        os.set_inheritable(fds[3], True)
        env["PMI_FD"] = str(fds[3])
    for fd in fds[:3]:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    # what `python -m` would have first on sys.path (the cwd), or `python file` (the file's folder);
    # PYTHONPATH after it
    first = os.path.dirname(os.path.abspath(request["path"])) if "path" in request else os.getcwd()
    extra = [first] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path[:len(extra)]]
    import torch
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    import io  # unbuffered, as PYTHONUNBUFFERED=1 makes a launched rank's: progress bars show live
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", 0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", 0), write_through=True)
    code = 0
    try:  # what `python -m MODULE ARGS` or `python FILE ARGS` runs, as the cold rank would
        import runpy
        if "module" in request:
            sys.argv = ["-m", *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(request["argv"])
            runpy.run_path(request["path"], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # sys.exit("message"), as Python prints it
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    if "path" in request:
        # a user's script registers exit handlers (the watchdog's done mark and job directory
        # when no launch.run made one): Python's exit would run them, and this one is skipped
        import atexit
        atexit._run_exitfuncs()
    # MPI_Finalize, then libc's exit, which runs MPICH's C exit handlers: os._exit skips them and
    # mpiexec SIGKILLs the job (bare mpi4py at 4 ranks, Finalize then os._exit: 2 of 4 runs).
    # Called holding the GIL (PyDLL): an extension's exit handler may call into Python. Python's
    # own finalization is skipped: with torch loaded it costs a cold rank a second and more.
    import ctypes
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.PyDLL(None).exit(code)


# ------------------------------------------------------------------------------------ the zygote
def serve(path: str) -> None:
    """Import torch, listen on `path`, fork a rank per stub; end when stdin closes (the parent's
    end of the pipe: the process that started us is gone)."""
    import torch  # noqa: F401  the point of this process
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the socket appears only when the zygote is ready
    server.listen(64)
    jobs = registry(path)  # which job each live fork belongs to: launch.job_pids reads it
    os.makedirs(jobs, exist_ok=True)
    children: dict[int, socket.socket | None] = {}  # child pid -> its stub's connection
    by_conn: dict[socket.socket, int] = {}
    while True:
        ready, _, _ = select.select([server, sys.stdin, *by_conn], [], [], 0.05)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            break
        if server in ready:
            conn, _ = server.accept()
            request, fds = _recv(conn)
            if request is None:
                conn.close()
                continue
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                for c in by_conn:
                    c.close()
                conn.close()
                _become_rank(request, fds)
            for fd in fds:
                os.close(fd)
            with open(os.path.join(jobs, str(pid)), "w") as f:
                f.write(request["env"].get("MINIZERO_JOB_ID", ""))
            children[pid], by_conn[conn] = conn, pid
            _send(conn, {"pid": pid})
        for conn in [c for c in ready if c in by_conn]:
            if not conn.recv(1):  # the stub is gone: mpirun ended the job; so does its rank
                pid = by_conn.pop(conn)
                children[pid] = None
                conn.close()
                _kill(pid)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(jobs, str(pid)))
            if conn is None:
                continue
            by_conn.pop(conn, None)
            ended = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else \
                {"code": os.WEXITSTATUS(status)}
            try:
                _send(conn, ended)
            except OSError:
                pass
            conn.close()
    for pid in children:
        _kill(pid)
    server.close()
    os.unlink(path)


def registry(path: str) -> str:
    """The folder where the zygote listening on `path` names each live fork's MINIZERO_JOB_ID (a
    fork's /proc/<pid>/environ is the zygote's, so the job's marker is not there)."""
    return path + ".jobs"


def job_pids(path: str | None, job_id: str) -> list[int]:
    """The live forks of the zygote at `path` that are ranks of job `job_id`."""
    if not path or not os.path.isdir(registry(path)):
        return []
    pids = []
    for name in os.listdir(registry(path)):
        try:
            with open(os.path.join(registry(path), name)) as f:
                if f.read() != job_id:
                    continue
            with open(f"/proc/{name}/stat") as f:  # killed and not yet reaped: ended
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    pids.append(int(name))
        except (OSError, ValueError):
            pass  # reaped meanwhile
    return pids


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    # run as a file, not `-m minizero.zygote`: no minizero module is in memory before a fork; and
    # this file's folder off sys.path, where minizero/data.py would shadow a `data` module
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    if sys.argv[1] == "stub":  # launch.run's rank: `python -m minizero.launch TARGET DIR`
        stub({"module": "minizero.launch", "argv": sys.argv[2:4]})
    elif sys.argv[1] == "script":  # `python FILE ARGS`, forked
        stub({"path": sys.argv[2], "argv": sys.argv[2:]})
    else:
        serve(sys.argv[2])
