"""The two ways minizero moves bytes, behind one small interface, and the async handle.

  * MPIBackend   : mpi4py on CPU tensors through zero-copy numpy views. Default on CPU under
                   mpirun: at 2 ranks, 16 MB it all-reduces ~3x faster than gloo, and gloo
                   emulates reduce-scatter with an all-reduce.
  * TorchBackend : torch.distributed. NCCL on CUDA (one rank per GPU), gloo on CPU.
                   Bootstrapped from MPI's rank/size under mpirun (init_torch_distributed), or
                   wrapping an already-initialized default group (torchrun, mp.spawn).

A backend knows nothing of accounting or checks: `Communicator` does those once, for both.
Every op returns a `Work` handle; the heartbeat records which op each rank is in, so a
launcher can say "timed out: rank 2 in all_gather" instead of just "timed out".
"""
from __future__ import annotations

import os
import socket
import sys
import time

import torch

from minizero import env as mz_env
from minizero.comm.labels import label
from minizero.comm.launcher import launched_rank, launcher


class _Heartbeat:
    """Writes 'which collective am I in' to a per-rank file, rank{r}.op in a directory shared by the
    job's ranks (MINIZERO_HEARTBEAT_DIR: launch.run's, or the one comm/watchdog.py sets up).

    Two pwrite syscalls per collective: cheap, and it lets a launcher or the watchdog say
    "timed out: rank 2 in all_gather" instead of just "timed out". A rank is IN a collective only
    while it blocks in one; an async op launched and not waited for reads "idle (in flight:
    ...)"."""

    def __init__(self):
        self.fd = None
        self.directory = None  # where the job's heartbeat files live
        self.text = ""         # the last state written
        self.since = 0.0       # time.monotonic() when it was written
        # what the code above the collectives is doing, e.g. "pipeline F2 on stage 1"
        self.context = ""

    def open(self, rank: int, directory: str | None = None):
        d = directory or mz_env.get("MINIZERO_HEARTBEAT_DIR")
        if d and self.fd is None:
            self.directory = d
            self.fd = os.open(os.path.join(d, f"rank{rank}.op"), os.O_WRONLY | os.O_CREAT, 0o644)
            with open(os.path.join(d, f"rank{rank}.pid"), "w") as f:
                f.write(str(os.getpid()))

    def beat(self, text: str):
        if self.fd is not None:
            if self.context:
                text = f"{text} [during {self.context}]"
            self.text, self.since = text, time.monotonic()
            data = text.encode()[:300].ljust(300)
            os.pwrite(self.fd, data, 0)

    def set_context(self, text: str):
        """Say what this rank is doing between collectives (a pipeline action): every beat carries
        it, so a rank that dies or hangs is reported with it. "" clears it."""
        self.context = text
        self.beat("idle")


def describe_ranks(directory: str, nprocs: int, ages: bool = False) -> dict[int, str]:
    """What each rank of a job was doing, from its heartbeat file (and, with `ages`, for how long,
    and whether its process is stopped): the words of launch.run's timeouts and of the watchdog."""
    where = {}
    for r in range(nprocs):
        path, text, age, state = os.path.join(directory, f"rank{r}.op"), "", None, ""
        try:
            with open(path) as f:
                text = f.read().strip()
            age = time.time() - os.path.getmtime(path)
            with (
                open(os.path.join(directory, f"rank{r}.pid")) as f,
                open(f"/proc/{int(f.read())}/stat") as st,
            ):
                state = st.read().rsplit(")", 1)[1].split()[0]  # R running, S sleeping, T stopped
        except (OSError, ValueError, IndexError):
            pass
        since = f" for {age:.0f}s" if ages and age is not None else ""
        if not text:
            desc = "had not reached a collective (starting up, or stuck in its own code)"
        elif text.startswith("idle"):
            desc = f"was in its own code, not a collective{since} ({text})"
        else:
            desc = f"in {text}{since}"
        where[r] = desc + (
            " - its process is STOPPED (SIGSTOP, a debugger?)" if ages and state == "T" else ""
        )
    return where


heartbeat = _Heartbeat()


class Work:
    """An async handle: `wait()` blocks until the op is done (and copies back, if needed).
    `poll()`, when the backend gives one, says without blocking whether the op has finished."""

    def __init__(self, waiter, op: str, on_done=None, poll=None):
        self._waiter = waiter    # blocks until the backend says the op is done
        self._op = op            # what the heartbeat reports while a rank waits here
        self._on_done = on_done  # the backend's finishing touch (avg's division, a copy back)
        self._poll = poll        # non-blocking "done yet?" (MPI Test, torch is_completed), or None
        self._done = False

    def wait(self, sleep_s: float | None = None):
        """Block until done. sleep_s: poll and sleep between polls instead of letting the backend
        spin (MPICH busy-polls a core while it waits: with more ranks than cores, the spinning
        ranks take the CPU from the ranks that compute)."""
        if not self._done:
            heartbeat.beat(self._op)
            try:
                # a profiler range (comm/labels.py): this rank blocked on the op
                with label("mz.wait"):
                    if sleep_s is not None and self._poll is not None:
                        while not self._poll():
                            time.sleep(sleep_s)
                    self._waiter()
            except Exception as e:  # noqa: BLE001  gloo's RuntimeError, mpi4py's MPI.Exception
                if _peer_lost(e):
                    raise RankLost(
                        e, heartbeat.text if heartbeat.fd is not None else self._op
                    ) from None
                raise
            if self._on_done:
                self._on_done()
            self._done = True
            heartbeat.beat(f"idle (last: wait {self._op})")
        return True

    def is_completed(self) -> bool:
        if not self._done and self._poll is not None and self._poll():
            self.wait()
        return self._done



class RankLost(RuntimeError):
    """A collective failed because a peer process ended in the middle of it (kill -9, the OOM
    killer): the backend's own error, said in one line. comm.init's excepthook (report_rank_lost)
    prints just this line (no traceback of the survivor's code: the fault is the dead rank's), and
    only when no job reaper (comm/reaper.py) names the dead rank instead."""

    def __init__(self, error: Exception, doing: str):
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        super().__init__(f"rank {launched_rank()}: a peer rank ended during "
                         f"{doing or 'a collective'} (killed: SIGKILL, the OOM killer? the "
                         f"launcher's report names its process) [{first}]")


def _peer_lost(error: Exception) -> bool:
    """The backend's error says the other side of a connection went away."""
    # only a failed process: a truncation is the caller's bug
    if type(error).__module__ == "mpi4py.MPI":
        mpi = mpi_module()
        failed = (getattr(mpi, "ERR_PROC_FAILED", -1), getattr(mpi, "ERR_PROC_FAILED_PENDING", -1))
        return error.Get_error_class() in failed
    text = str(error)
    return any(w in text for w in ("Connection closed by peer", "Connection reset by peer",
                                   "remote worker crash"))


def report_rank_lost(kind, value, tb, prior=sys.excepthook):
    """sys.excepthook of a multi-rank process (comm.init): RankLost in one line, anything else as
    before."""
    if not isinstance(value, RankLost):
        return prior(kind, value, tb)
    if not reaper_running():
        sys.stderr.write(f"minizero: {value}\n")
        sys.stderr.flush()


def reaper_running() -> bool:
    """comm/watchdog.py started a job reaper for this job (it names a dead rank itself)."""
    return heartbeat.directory is not None and not mz_env.is_set("MINIZERO_HEARTBEAT_DIR")


# ----------------------------------------------------------------------------- mpi backend
def mpi_module():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - install problem
        raise RuntimeError(
            "mpi4py is not installed: run `make setup` (or pip install mpi4py mpich)"
        ) from e
    return MPI


class MPIBackend:
    """mpi4py on numpy views of CPU tensors (zero-copy). MPI has no fp16/bf16 arithmetic,
    so reductions of 16-bit tensors go through an fp32 scratch copy (counted bytes stay
    those of the 16-bit payload: the accounting is the model's, not this emulation's).

    CUDA tensors are staged through the host: copied to a CPU buffer, moved by MPI, copied back
    when the op completes. That is how several ranks share ONE GPU (NCCL refuses two ranks on one
    device, and gloo has no CUDA reduce-scatter, all-to-all or send/recv): the GPU check runs its
    multi-rank parts this way. `stage_all` stages CPU tensors too, so the CPU suite runs that
    path."""

    def __init__(self, mpi_comm, stage_all: bool = False):
        self.MPI = mpi_module()
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.stage_all = stage_all
        self._ops = {"sum": self.MPI.SUM, "avg": self.MPI.SUM, "max": self.MPI.MAX,
                     "min": self.MPI.MIN}

    def _staged(self, t) -> bool:
        return self.stage_all or t.device.type != "cpu"

    def _host(self, t, read=True):
        """The CPU tensor MPI works on for `t`: t itself, or (staged) a host copy of it (read=True)
        or an empty host buffer of its shape (read=False: an output the op overwrites)."""
        t = t.detach()
        if not self._staged(t):
            return t
        return t.to("cpu", copy=True) if read else torch.empty(t.shape, dtype=t.dtype, device="cpu")

    @staticmethod
    def _back(t, host):
        """on_done of an op that writes `t`: copy the host buffer back into it when it was
        staged."""
        def done():
            if host.data_ptr() != t.data_ptr():
                t.detach().copy_(host)
        return done

    @staticmethod
    def _view(t):
        """Raw numpy view for data movement (bit-exact, any dtype)."""
        t = t.detach()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        elif t.dtype == torch.bool:
            t = t.view(torch.uint8)
        return t.numpy()

    def _reduction(self, tensors, start, op):
        """Run a reduction; for 16-bit floats (and staged tensors) reduce a host fp32 copy and write
        it back."""
        # fp16 or bf16: MPI has neither
        sixteen_bit = tensors[0].dtype in (torch.bfloat16, torch.float16)
        work = [self._host(t).float() if sixteen_bit else self._host(t) for t in tensors]
        req = start(*[w.numpy() for w in work], self._ops[op])

        def done():
            out = work[0]
            if op == "avg":
                out.div_(self.size)
            if sixteen_bit or self._staged(tensors[0]):
                tensors[0].detach().copy_(out)
        return Work(req.Wait, "reduction", done)

    def all_reduce(self, t, op):
        return self._reduction([t], lambda b,
                               mop: self.mpi_comm.Iallreduce(self.MPI.IN_PLACE, b, mop), op)

    def reduce_scatter(self, out, inp, op):
        return self._reduction([out, inp], lambda o, i,
                               mop: self.mpi_comm.Ireduce_scatter_block(i, o, mop), op)

    def reduce(self, t, dst, op):
        if self.rank == dst:
            return self._reduction([t], lambda b,
                                   mop: self.mpi_comm.Ireduce(self.MPI.IN_PLACE, b, mop, root=dst),
                                   op)
        # non-roots only send; their tensor is left as it was
        buf = self._host(t)
        if t.dtype in (torch.bfloat16, torch.float16):
            buf = buf.float()
        return Work(self.mpi_comm.Ireduce(buf.numpy(), None, self._ops[op], root=dst).Wait,
                    "reduce")

    def all_gather(self, out, inp):
        h_out = self._host(out, read=False)
        req = self.mpi_comm.Iallgather(self._view(self._host(inp)), self._view(h_out))
        return Work(req.Wait, "all_gather", self._back(out, h_out))

    def broadcast(self, t, src):
        h = self._host(t)
        return Work(self.mpi_comm.Ibcast(self._view(h), root=src).Wait, "broadcast",
                    self._back(t, h))

    def all_to_all(self, out, inp):
        h_out = self._host(out, read=False)
        req = self.mpi_comm.Ialltoall(self._view(self._host(inp)), self._view(h_out))
        return Work(req.Wait, "all_to_all", self._back(out, h_out))

    def isend(self, t, dst, tag):
        h = self._host(t)
        req = self.mpi_comm.Isend(self._view(h), dest=dst, tag=tag)
        # the handle keeps a staged copy alive
        return Work(req.Wait, "send", on_done=lambda h=h: None, poll=req.Test)

    def irecv(self, t, src, tag):
        h = self._host(t, read=False)
        req = self.mpi_comm.Irecv(self._view(h), source=src, tag=tag)
        return Work(req.Wait, "recv", self._back(t, h), poll=req.Test)

    def barrier(self):
        self.mpi_comm.Barrier()

    def ibarrier(self):
        req = self.mpi_comm.Ibarrier()
        return Work(req.Wait, "barrier", poll=req.Test)

    def allgather_obj(self, obj):
        return self.mpi_comm.allgather(obj)

    def split(self, color, key):
        return MPIBackend(self.mpi_comm.Split(color, key), self.stage_all)



# ----------------------------------------------------------------------------- torch backend
class TorchBackend:
    """torch.distributed: NCCL on CUDA, gloo on CPU. Groups map group ranks to global ones."""

    def __init__(self, group=None, ranks=None):
        import torch.distributed as dist
        self.dist = dist    # torch.distributed, imported late: `import minizero` stays light
        self.group = group  # the torch ProcessGroup (None: the default, whole world)
        # the group's members as global ranks: torch's p2p and roots take global ranks
        self.ranks = ranks if ranks is not None else list(range(dist.get_world_size()))
        self.rank = self.ranks.index(dist.get_rank())
        self.size = len(self.ranks)
        rop = dist.ReduceOp
        self._ops = {"sum": rop.SUM, "avg": rop.SUM, "max": rop.MAX, "min": rop.MIN}

    def _maybe_avg(self, t, op, work):
        def done():
            if op == "avg":
                t.detach().div_(self.size)
        return Work(work.wait if work is not None else (lambda: None), op, done)

    def all_reduce(self, t, op):
        w = self.dist.all_reduce(t.detach(), self._ops[op], group=self.group, async_op=True)
        return self._maybe_avg(t, op, w)

    def reduce_scatter(self, out, inp, op):
        # *_single: the forms that do not emit FutureWarnings in torch 2.13 (older torch: *_tensor)
        reduce_scatter = (
            getattr(self.dist, "reduce_scatter_single", None) or self.dist.reduce_scatter_tensor
        )
        w = reduce_scatter(out.detach(), inp.detach(), self._ops[op], group=self.group,
                           async_op=True)
        return self._maybe_avg(out, op, w)

    def reduce(self, t, dst, op):
        w = self.dist.reduce(t.detach(), self.ranks[dst], self._ops[op], group=self.group,
                             async_op=True)
        return self._maybe_avg(t, op if self.rank == dst else "sum", w)

    def all_gather(self, out, inp):
        all_gather = (
            getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        )
        return Work(all_gather(out.detach(), inp.detach(), group=self.group, async_op=True).wait,
                    "all_gather")

    def broadcast(self, t, src):
        return Work(
            self.dist.broadcast(t.detach(), self.ranks[src], group=self.group, async_op=True).wait,
            "broadcast",
        )

    def all_to_all(self, out, inp):
        return Work(
            self.dist.all_to_all_single(
                out.detach(), inp.detach(), group=self.group, async_op=True
            ).wait,
            "all_to_all",
        )

    # No poll: gloo's p2p work reports is_completed() only once wait() ran (so polling would never
    # end), and its wait() sleeps on a condition variable instead of spinning, so it needs none.
    def isend(self, t, dst, tag):
        return Work(self.dist.isend(t.detach(), self.ranks[dst], group=self.group, tag=tag).wait,
                    "send")

    def irecv(self, t, src, tag):
        return Work(self.dist.irecv(t.detach(), self.ranks[src], group=self.group, tag=tag).wait,
                    "recv")

    def barrier(self):
        self.dist.barrier(group=self.group)

    def ibarrier(self):  # no poll, as isend's: gloo's wait() already sleeps
        return Work(self.dist.barrier(group=self.group, async_op=True).wait, "barrier")

    def allgather_obj(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def split(self, color, key):
        # torch.distributed.new_group must be called by every rank for every group, in the
        # same order: exchange (color, key) first, then build all groups deterministically.
        info = self.allgather_obj((color, key, self.ranks[self.rank]))
        mine = None
        for c in sorted({c for c, _, _ in info}):
            members = [g for cc, _, g in sorted(info, key=lambda x: (x[1], x[2])) if cc == c]
            grp = self.dist.new_group(members)
            if c == color:
                mine = TorchBackend(grp, members)
        return mine


def init_torch_distributed(device: torch.device, timeout_s: float | None = None):
    """Start torch.distributed (NCCL on CUDA, gloo on CPU) unless it runs already, from whichever
    launcher started this process (comm/launcher.py):
      * torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): its env:// rendezvous;
      * mpirun: MPI's rank and size, rank 0 picks a free port and broadcasts it, so no
        MASTER_ADDR/PORT needs setting by hand;
      * nothing: a world of one on a free local port (WORLD_SIZE > 1 without the rest is an error).
    A rendezvous that does not complete within `timeout_s` (MINIZERO_INIT_TIMEOUT_S, default 60)
    is an error saying who was waited for, instead of torch's 30 minutes of silence. The collectives
    after it keep torch's default timeout: a step may take minutes."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout_s = mz_env.get("MINIZERO_INIT_TIMEOUT_S") if timeout_s is None else timeout_s
    which, env = launcher(), os.environ
    if which == "torchrun":
        rank, size, url = int(env["RANK"]), int(env["WORLD_SIZE"]), "env://"
        where = f"MASTER_ADDR={env['MASTER_ADDR']} MASTER_PORT={env['MASTER_PORT']}"
    elif which == "mpi":
        c = mpi_module().COMM_WORLD
        rank, size = c.Get_rank(), c.Get_size()
        addr_port = None
        if rank == 0:
            s = socket.socket()
            s.bind(("127.0.0.1" if size == 1 else "", 0))
            port = s.getsockname()[1]
            s.close()
            addr_port = (
                socket.gethostbyname(socket.gethostname())
                if mz_env.get("MINIZERO_MULTINODE")
                else "127.0.0.1",
                port,
            )
        addr, port = c.bcast(addr_port, root=0)
        url, where = f"tcp://{addr}:{port}", f"{addr}:{port} (from MPI rank 0)"
    else:
        if int(env.get("WORLD_SIZE", "1")) > 1:
            missing = [
                v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in env
            ]
            raise RuntimeError(f"WORLD_SIZE={env['WORLD_SIZE']} but {', '.join(missing)} not set: "
                               "start the ranks with `torchrun --nproc_per_node N ...` (it sets "
                               "all four) or `mpirun -n N ...`, or unset WORLD_SIZE to run on one "
                               "rank")
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        rank, size, url = 0, 1, f"tcp://127.0.0.1:{s.getsockname()[1]}"
        s.close()
        where = url
    def failed(why: str) -> RuntimeError:
        return RuntimeError(f"rank {rank} of {size}: the torch.distributed rendezvous at {where} "
                            f"did not complete within {timeout_s:g} s ({why}). Are all {size} "
                            "ranks started, and can they reach that address? torchrun starts them "
                            "all; a hand-set WORLD_SIZE needs every rank (MINIZERO_INIT_TIMEOUT_S "
                            "sets the wait).")

    started = time.monotonic()
    if which == "torchrun" and rank != 0 and not _reachable(env["MASTER_ADDR"],
                                                            int(env["MASTER_PORT"]), timeout_s):
        # torch's client would retry for twice the timeout,
        # printing a C++ stack dump per try (134 s at 60)
        raise failed(f"nothing listens at {env['MASTER_ADDR']}:{env['MASTER_PORT']}: rank 0's "
                     "store never started")
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=url,
                                rank=rank, world_size=size, timeout=datetime.timedelta(
                                    seconds=max(1.0, timeout_s - (time.monotonic() - started))))
    except Exception as e:  # noqa: BLE001  torch raises several types for a failed rendezvous
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise failed(f"{type(e).__name__}: {first}") from None
    # init_process_group's timeout is also every later collective's: a rank waiting at a gather
    # while another finishes a minute-long step (bench scale: 113 s steps at 2.1B parameters) would
    # fail after timeout_s. Collectives get torch's own default back (30 min for gloo, 10 for NCCL);
    # the watchdog (MINIZERO_WATCHDOG_S) names a hung rank long before that.
    from torch.distributed import constants

    dist.distributed_c10d._set_pg_timeout(
        (device.type == "cuda" and constants.default_pg_nccl_timeout)
        or constants.default_pg_timeout
    )


def _reachable(addr: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts connections at addr:port within timeout_s (tried every 0.2 s,
    silently)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(
                (addr, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))
            ).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
