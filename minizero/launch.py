"""minizero.launch: run a function on N MPI ranks from Python, safely.

    results = launch.run("minizero.cli.demo:train_worker", nprocs=4, args={"steps": 20}, timeout=60)

starts `mpirun -n 4 python -m minizero.launch ...` in a subprocess. Each rank builds the
global Communicator, calls `fn(comm, **args)` and returns a JSON-serializable value;
`run` returns the list of those values in rank order.

Why a subprocess: notebooks and pytest never run collectives in their own process, so one
bad rank cannot hang the kernel or the grader. What goes wrong is reported, not hung on:
  * a rank raises      -> RankError carrying that rank's traceback (the job is aborted at
                          once, so the other ranks do not sit in a collective forever);
  * the job times out  -> every process of the job is killed, and LaunchTimeout says which
                          collective each rank was in (from the per-rank heartbeat that
                          minizero.comm writes before and after every op);
  * mpirun is missing  -> an error that says how to get it.
"""
from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid

from minizero import zygote


class LaunchError(RuntimeError):
    """The job failed; `output` holds the tail of what the ranks printed."""

    def __init__(self, msg, output=""):
        super().__init__(msg)
        self.output = output


class RankError(LaunchError):
    """A rank raised. `rank` and `rank_traceback` say which and where."""

    def __init__(self, rank, tb, output=""):
        last = tb.strip().splitlines()[-1] if tb.strip() else "?"
        super().__init__(f"rank {rank} failed: {last}\n\n--- traceback of rank {rank} ---\n{tb}",
                         output)
        self.rank, self.rank_traceback, self.last_line = rank, tb, last


class LaunchTimeout(LaunchError):
    """The job ran past its timeout and was killed. `where[r]` is rank r's last heartbeat."""

    def __init__(self, timeout, where, output=""):
        desc = "; ".join(f"rank {r} {w}" for r, w in sorted(where.items()))
        super().__init__(f"timed out after {timeout:g}s: {desc}", output)
        self.where, self.timeout = where, timeout


def find_mpirun() -> str:
    """mpirun from PATH, else next to this Python (the mpich wheel puts it in the venv's bin/)."""
    for cand in (shutil.which("mpirun"), os.path.join(os.path.dirname(sys.executable), "mpirun")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise LaunchError("mpirun not found. Run `make setup` (it installs the `mpich` wheel, which "
                      "puts mpirun in .venv/bin/), or `pip install mpi4py mpich`, then use "
                      ".venv/bin/python.")


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on now (on every interface by default), as the OS hands one out
    (what `torchrun --standalone` does): a fixed default such as 29500 is shared by every job on the
    machine, and two jobs that meet at one store mix their ranks. Free when asked; whoever binds it
    next wins."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def timeout_scale() -> float:
    """MINIZERO_TIMEOUT_SCALE's factor now: a job's timeout guards against a hang on an idle
    machine, and a busy one must not turn it into a failure."""
    from minizero import env as mz_env
    scale = mz_env.get("MINIZERO_TIMEOUT_SCALE")
    return mz_env.load_scale() if scale == "load" else scale


def max_ranks() -> int:
    """Oversubscribing 2 cores with more than 8 ranks makes runs slow and flaky; raise the
    cap with MINIZERO_MAX_RANKS when you have the cores."""
    from minizero import env as mz_env
    return mz_env.get("MINIZERO_MAX_RANKS")


def run(target: str, nprocs: int = 2, args: dict | None = None, timeout: float = 120,
        backend: str | None = None, env: dict | None = None, stream=False) -> list:
    """Run `target` ("pkg.module:function" or "path/to/file.py:function") on `nprocs` ranks.

    The function is called as fn(comm, **args) on every rank. Returns the per-rank results.
    `stream=True` echoes the ranks' output live to stdout (progress bars), `stream=sys.stderr` to
    that file (a report on stdout stays clean); it is captured either way."""
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if nprocs > max_ranks():
        raise LaunchError(f"asked for {nprocs} ranks but this machine allows at most {max_ranks()} "
                          f"(set MINIZERO_MAX_RANKS to raise the cap if you have the cores)")
    if ":" not in target:
        raise ValueError(
            f"target {target!r} must look like 'module:function' or 'file.py:function'"
        )
    timeout *= timeout_scale()
    path, _, _ = target.rpartition(":")
    if path.endswith(".py"):
        if not os.path.exists(path):
            raise FileNotFoundError(f"target file {path} does not exist")
        target = os.path.abspath(path) + ":" + target.rpartition(":")[2]
    # the ranks' MINIZERO_* variables, checked once here, not by every rank
    from minizero import env as mz_env
    mz_env.check({**os.environ, **({"MINIZERO_BACKEND": backend} if backend else {}),
                  **(env or {})})
    mpirun = find_mpirun()
    job_id = uuid.uuid4().hex[:12]
    with tempfile.TemporaryDirectory(prefix="minizero-") as tmp:
        with open(os.path.join(tmp, "args.json"), "w") as f:
            json.dump(args or {}, f)
        child_env = dict(os.environ)
        child_env.setdefault("OMP_NUM_THREADS", "1")
        child_env.update({"MINIZERO_HEARTBEAT_DIR": tmp, "MINIZERO_JOB_ID": job_id,
                          "PYTHONUNBUFFERED": "1",
                          "PYTHONPATH": os.pathsep.join([_repo_root(), os.getcwd(),
                                                         child_env.get("PYTHONPATH", "")])})
        if backend:
            child_env["MINIZERO_BACKEND"] = backend
        child_env.update(env or {})
        if _use_zygote(child_env):
            child_env[zygote.SOCKET_VAR] = _zygote_socket(child_env)
            rank_module = [zygote.__file__, "stub"]
        else:
            rank_module = ["-m", "minizero.launch"]
        cmd = [mpirun, "-n", str(nprocs), sys.executable, *rank_module, target, tmp]
        # start_new_session: the whole job (mpiexec, proxies, ranks) is one process group
        # we can kill at once on timeout.
        live = _Liveness(os.path.join(tmp, "live.sock"))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=child_env, start_new_session=True, stdin=subprocess.DEVNULL)
        chunks: list[str] = []
        reader = threading.Thread(target=_pump, args=(proc.stdout, chunks, stream), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            where = _heartbeats(tmp, nprocs)
            _kill_job(proc, job_id)
            reader.join(2)
            live.close()
            raise LaunchTimeout(timeout, where, _tail(chunks)) from None
        finally:
            if proc.poll() is None:
                _kill_job(proc, job_id)
        time.sleep(0.05)  # let the liveness thread see the last disconnects
        live.close()
        dead = _first_dead(tmp, nprocs, live.gone) if proc.returncode != 0 else []
        where = _heartbeats(tmp, nprocs)
        reader.join(5)
        _kill_job(proc, job_id)  # stragglers (none expected once mpiexec exited)
        output = _tail(chunks)
        errors = sorted((os.path.getmtime(os.path.join(tmp, f)), int(f[4:-4]), f)
                        for f in os.listdir(tmp) if f.startswith("rank") and f.endswith(".err"))
        if errors:
            _, rank, fname = errors[0]  # the first rank to fail is the cause; others follow it
            with open(os.path.join(tmp, fname)) as f:
                raise RankError(rank, f.read(), output)
        if dead:
            others = "; ".join(f"rank {r} {w}" for r, w in sorted(where.items()) if r not in dead)
            raise LaunchError(f"rank {dead[0]} died without a Python traceback: killed by the OS "
                              "or a signal (out of memory?), or crashed in native code, and "
                              f"mpirun ended the job. Its last heartbeat: {where[dead[0]]}. The "
                              f"other ranks were: {others}.\n{output}", output)
        if proc.returncode != 0:
            raise LaunchError(f"mpirun exited with code {proc.returncode} and no rank reported an "
                              f"error. Output:\n{output}", output)
        results = []
        for r in range(nprocs):
            p = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(p):
                raise LaunchError(f"rank {r} wrote no result. Output:\n{output}", output)
            with open(p) as f:
                results.append(json.load(f))
        return results


def _use_zygote(env: dict) -> bool:
    """MINIZERO_ZYGOTE, or when unset: on where no NVIDIA GPU is (the forks have run on CPU only;
    a CUDA context must never exist in the zygote, and make test-gpu has not run them yet)."""
    from minizero import env as mz_env
    chosen = mz_env.get("MINIZERO_ZYGOTE", env)
    return not os.path.exists("/dev/nvidiactl") if chosen is None else chosen


_ZYGOTE: dict = {}  # the zygote in use: {"proc": Popen if this process started it, "path": socket}


def share_zygote() -> str | None:
    """Start this process's zygote now and name its socket in os.environ (zygote.SOCKET_VAR): the
    processes started from here on (a notebook kernel, the grader's commands) fork their ranks
    from it too, instead of each importing torch once more in a zygote of its own."""
    if not _use_zygote(dict(os.environ)):
        return None
    path = _zygote_socket(dict(os.environ))
    if not os.path.exists(path):
        return None
    os.environ[zygote.SOCKET_VAR] = path
    return path


def _serves_this_python(path: str) -> bool:
    """Whether `path` is a live zygote's socket run by this interpreter (a parent's zygote in
    another virtual environment would fork ranks with its own torch)."""
    try:
        with open(path + ".python") as f:
            return os.path.exists(path) and f.read() == sys.executable
    except OSError:
        return False


def _zygote_socket(env: dict) -> str:
    """The socket of the zygote (minizero/zygote.py) this process's ranks fork from: its own,
    started on first use and ending when this process does (its stdin is our pipe), or the one a
    parent shared through `env` (share_zygote)."""
    proc = _ZYGOTE.get("proc")
    if proc is not None and proc.poll() is None:
        return _ZYGOTE["path"]
    shared = env.get(zygote.SOCKET_VAR, "")
    if proc is None and _serves_this_python(shared):
        _ZYGOTE["path"] = shared
        return shared
    folder = tempfile.mkdtemp(prefix="minizero-zygote-")
    path = os.path.join(folder, "socket")
    # not this job's markers: the zygote outlives the job, and _kill_job finds a job's processes
    # by its MINIZERO_JOB_ID
    env = {k: v for k, v in env.items()
           if k not in ("MINIZERO_JOB_ID", "MINIZERO_HEARTBEAT_DIR", zygote.SOCKET_VAR)}
    try:
        proc = subprocess.Popen([sys.executable, zygote.__file__, "serve", path],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    except OSError:
        return path  # no zygote: each stub runs its rank itself
    atexit.register(shutil.rmtree, folder, True)
    with open(path + ".python", "w") as f:
        f.write(sys.executable)
    deadline = time.time() + 120 * timeout_scale()
    while not os.path.exists(path) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    _ZYGOTE.update(proc=proc, path=path)
    return path  # not there (it died or is slow): each stub runs its rank itself


def _repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pump(stream, chunks, echo):
    # raw chunks, not lines: a progress bar redraws with '\r' and no newline
    for data in iter(lambda: os.read(stream.fileno(), 65536), b""):
        text = data.decode(errors="replace")
        chunks.append(text)
        if len(chunks) > 4000:
            del chunks[:2000]
        if echo:
            out = echo if hasattr(echo, "write") else sys.stdout
            out.write(text)
            out.flush()
    stream.close()


def _tail(chunks, n=12000):
    return "".join(chunks)[-n:]


class _Liveness:
    """Each rank keeps a unix-socket connection to the launcher open for its whole life. When a
    rank dies, the kernel closes it: the ORDER of those disconnects tells which rank died
    first, even though mpirun kills the other ranks a few milliseconds later (it does, even
    with -disable-auto-cleanup, so the processes' final state cannot tell them apart)."""

    def __init__(self, path):
        import selectors
        import socket
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(64)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.server, selectors.EVENT_READ)
        self.gone: list[int] = []  # ranks in the order their connection closed
        self.stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        import selectors
        while not self.stop:
            for key, _ in self.sel.select(timeout=0.1):
                if key.fileobj is self.server:
                    conn, _ = self.server.accept()
                    self.sel.register(conn, selectors.EVENT_READ, data=None)
                    continue
                data = key.fileobj.recv(64)
                if data and key.data is None:
                    self.sel.modify(key.fileobj, selectors.EVENT_READ,
                                    data=int(data.split(b"\n")[0]))
                elif not data:
                    if key.data is not None:
                        self.gone.append(key.data)
                    self.sel.unregister(key.fileobj)
                    key.fileobj.close()

    def close(self):
        self.stop = True
        self.thread.join(1)
        self.server.close()


def _connect_liveness(tmp, rank):
    """Worker side: the connection stays open (kept in a global) until the process ends."""
    import socket
    global _LIVENESS_SOCKET
    try:
        _LIVENESS_SOCKET = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _LIVENESS_SOCKET.connect(os.path.join(tmp, "live.sock"))
        _LIVENESS_SOCKET.sendall(f"{rank}\n".encode())
    except OSError:
        pass  # liveness is a diagnostic; never fail a job over it


def _first_dead(tmp, nprocs, gone):
    """Ranks that vanished without a result or a traceback, the first to go first."""
    done = {r for r in range(nprocs) if os.path.exists(os.path.join(tmp, f"rank{r}.json"))
            or os.path.exists(os.path.join(tmp, f"rank{r}.err"))}
    return [r for r in gone if r not in done][:1]


def _heartbeats(tmp, nprocs):
    from minizero.comm.backends import describe_ranks  # the words the watchdog uses too
    return describe_ranks(tmp, nprocs)


def job_pids(job_id: str) -> list[int]:
    """PIDs of live processes started for this job (found by the MINIZERO_JOB_ID in their env)."""
    # ranks forked by a zygote carry the zygote's environment: the zygote names their job
    return pids_with_env("MINIZERO_JOB_ID", job_id) + zygote.job_pids(_ZYGOTE.get("path"), job_id)


def pids_with_env(name: str, value: str) -> list[int]:
    """PIDs of live processes whose environment has name=value (inherited by everything they start,
    jobs in sessions of their own included)."""
    marker = f"{name}={value}".encode()
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def _kill_job(proc, job_id):
    """Kill the process group, then anything of the job that escaped it (setsid'd proxies)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in job_pids(job_id):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def load_target(target: str):
    """'pkg.mod:fn' or '/abs/file.py:fn' -> the function."""
    path, _, fn_name = target.rpartition(":")
    if path.endswith(".py"):
        name = "_minizero_target_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    return getattr(module, fn_name)


def _worker(target: str, tmp: str):
    """What each rank runs under mpirun."""
    from minizero import comm as comm_mod
    # before the communicator: the liveness socket names the rank that dies
    rank = comm_mod.launched_rank()
    _connect_liveness(tmp, rank)
    try:
        with open(os.path.join(tmp, "args.json")) as f:
            args = json.load(f)
        comm = comm_mod.init()
        rank = comm.rank
        result = load_target(target)(comm, **args)
        with open(os.path.join(tmp, f"rank{rank}.json.tmp"), "w") as f:
            json.dump(result, f)
        os.replace(os.path.join(tmp, f"rank{rank}.json.tmp"), os.path.join(tmp, f"rank{rank}.json"))
        comm_mod.shutdown()
    except BaseException:
        with open(os.path.join(tmp, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        sys.stderr.write(f"[minizero] rank {rank} failed, aborting the "
                         f"job:\n{traceback.format_exc()}")
        sys.stderr.flush()
        time.sleep(0.2)  # let a rank that failed at the same moment write its traceback too
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)  # ends every rank now, instead of leaving them in a collective


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
