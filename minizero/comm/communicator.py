"""minizero.comm: one Communicator, two backends, every byte counted.

Every parallelism in this repo talks through a `Communicator`. It has the collectives a
trainer needs (all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all,
send/recv, barrier), `async_op=True` handles so communication can overlap compute, and
`split`/`new_group` for the DP/TP/PP/"node" sub-groups.

Backends (comm/backends.py), chosen in ONE place, `select_backend_and_device`, from the launcher
that started the process (comm/launcher.py):
  * "mpi"   : mpi4py on CPU tensors (the default on CPU under mpirun); CUDA tensors are staged
              through the host, so several ranks can share one GPU (MINIZERO_BACKEND=mpi; NCCL
              refuses that);
  * "torch" : torch.distributed, NCCL on CUDA and gloo on CPU.

Accounting (comm/stats.py): every call adds to `comm.stats` the bytes THIS rank sends under
the ring model of that op (all-reduce 2(N-1)/N·S, reduce-scatter and all-gather (N-1)/N·S,
...). Sub-communicators count into their own stats AND their parent's, so `world.stats` is
everything this rank sent. `comm/mesh.py` builds the DP/PP/TP/node sub-communicators.
"""
from __future__ import annotations

import atexit
import sys

import torch

from minizero import env as mz_env
from minizero import host
from minizero.comm.backends import (MPIBackend, TorchBackend, heartbeat, init_torch_distributed,
                                    mpi_module, report_rank_lost)
from minizero.comm.labels import label
from minizero.comm.launcher import launched_world_size, launcher, local_rank
from minizero.comm.stats import CommStats, ring_bytes_split

REDUCE_OPS = ("sum", "avg", "max", "min")


# ----------------------------------------------------------------------------- device choice
def select_backend_and_device(backend: str | None = None) -> tuple[str, torch.device]:
    """The single place that decides backend and device.

    CUDA present -> torch.distributed + NCCL, one rank per GPU (by local rank).
    CPU          -> mpi (faster than gloo here) under an MPI launcher only; torch.distributed +
                    gloo under torchrun, in a group already initialized (mp.spawn), and in a
                    plain `python` process (a world of one). MINIZERO_BACKEND overrides."""
    import torch.distributed as dist
    backend = backend or mz_env.get("MINIZERO_BACKEND")
    if backend not in (None, "mpi", "torch"):
        raise ValueError(f"unknown backend {backend!r}: use 'mpi' or 'torch'")
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return backend or "torch", device
    if backend is None:
        initialized = dist.is_available() and dist.is_initialized()
        backend = "mpi" if launcher() == "mpi" and not initialized else "torch"
    return backend, torch.device("cpu")


# ----------------------------------------------------------------------------- communicator
class Communicator:
    """rank/size/device plus counted collectives. Build one with `minizero.comm.init()`."""

    def __init__(self, backend: str, impl, device: torch.device, name="world", parent=None,
                 debug: bool | None = None):
        self.backend = backend    # "mpi" or "torch": which library moves the bytes
        self._impl = impl         # the MPIBackend / TorchBackend that does it (comm/backends.py)
        self.device = device      # where this rank's tensors live: cpu, or its own cuda:N
        self.name = name          # "world", or the group's name in errors and heartbeats
        self.parent = parent      # the communicator this one was split from (its stats roll up)
        self.rank = impl.rank     # this process's rank in THIS group
        self.size = impl.size     # ranks in this group
        self.stats = CommStats()  # bytes this rank sent through this group (comm/stats.py)
        self.parent_ranks = None  # parent_ranks[i]: member i's rank in the parent (set by split)
        # node_of[i]: the simulated node of member i (set_nodes; None: ask the parent)
        self.node_of = None
        # debug: compare shapes/dtypes across ranks before every collective (one extra
        # small all-gather each time): turns a silent hang or garbage into a clear error.
        self.debug = mz_env.get("MINIZERO_DEBUG") if debug is None else debug
        if parent is None:
            heartbeat.open(self.rank)

    def __repr__(self):
        return (f"Communicator({self.name}: rank {self.rank}/{self.size}, {self.backend}, "
                f"{self.device})")

    # -- bookkeeping shared by every op
    def set_nodes(self, node_of):
        """Which simulated node each rank of this group is on (the Mesh calls it). Groups split
        from this one inherit it; bytes are booked intra/cross-node from the next op on."""
        if len(node_of) != self.size:
            raise ValueError(f"set_nodes: {len(node_of)} entries for a group of {self.size}")
        self.node_of = list(node_of)

    def node_map(self):
        """node_map()[i] = node of member i, from the nearest set_nodes up the parents; None: one
        node."""
        members, c = list(range(self.size)), self
        while c.node_of is None:
            if c.parent is None:
                return None
            members, c = [c.parent_ranks[m] for m in members], c.parent
        return [c.node_of[m] for m in members]

    def _count(self, op, payload_bytes, peer=None):
        nodes = self.node_map()
        cross = 0.0 if nodes is None else ring_bytes_split(op, payload_bytes, nodes, self.rank,
                                                           peer)[1]
        c = self
        while c is not None:
            c.stats.add(op, payload_bytes, self.size, cross)
            c = c.parent

    def _enter(self, op, *tensors, check=True):
        for t in tensors:
            # MINIZERO_STRICT_HOST: what NCCL says of an offload tier's CPU tensor
            if host.is_host(t):
                raise ValueError(f"{op}: tensor on the host, communicator {self.name} is on the "
                                 "device (MINIZERO_STRICT_HOST=1: on a GPU this is 'tensor on "
                                 f"cpu, communicator {self.name} is on cuda'): move it with "
                                 ".to(comm.device) first")
            if t.device != self.device and not (self.backend == "mpi" and t.device.type == "cpu"):
                raise ValueError(f"{op}: tensor on {t.device}, communicator {self.name} is on "
                                 f"{self.device}")
            if not t.is_contiguous():
                raise ValueError(f"{op}: tensor of shape {tuple(t.shape)} is not contiguous; call "
                                 ".contiguous()")
        if self.debug and check and self.size > 1:
            sig = [(op, tuple(t.shape), str(t.dtype)) for t in tensors]
            sigs = self._impl.allgather_obj(sig)
            if any(s != sigs[0] for s in sigs):
                desc = "; ".join(f"rank {r}: {s}" for r, s in enumerate(sigs))
                raise ValueError(f"{op} on {self.name}: ranks disagree on shapes/dtypes: {desc}")
        self._where = (f"{op} ({sum(t.numel() * t.element_size() for t in tensors)} B) on "
                       f"{self.name}")
        heartbeat.beat(self._where)

    def _run(self, op, payload, launch, async_op):
        self._count(op, payload)
        # a profiler range (comm/labels.py): the launch, and the wait when blocking
        with label(f"mz.{op}"):
            work = launch()
            work._op = self._where  # so a stuck wait() reports the op, its size and group
            if async_op:  # launched, not waited for: this rank goes on computing
                heartbeat.beat(f"idle (in flight: {self._where})")
                return work
            work.wait()
        heartbeat.beat(f"idle (last: {op})")
        return None

    @staticmethod
    def _nbytes(t):
        return t.numel() * t.element_size()

    def _check_op(self, op, reduce_op):
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"{op}: unknown reduce op {reduce_op!r}; use one of {REDUCE_OPS}")

    # -- collectives. All work in place on `tensor` / write into `output`.
    def all_reduce(self, tensor, op="sum", async_op=False):
        self._check_op("all_reduce", op)
        self._enter("all_reduce", tensor)
        return self._run("all_reduce", self._nbytes(tensor),
                         lambda: self._impl.all_reduce(tensor, op), async_op)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        """output[i] = reduce over ranks of input[rank*k:(rank+1)*k], k = output.numel()."""
        self._check_op("reduce_scatter", op)
        if input.numel() != output.numel() * self.size or input.dtype != output.dtype:
            raise ValueError(f"reduce_scatter: input {tuple(input.shape)} {input.dtype} must hold "
                             f"{self.size} x output {tuple(output.shape)} {output.dtype}")
        self._enter("reduce_scatter", output, input)
        return self._run("reduce_scatter", self._nbytes(input),
                         lambda: self._impl.reduce_scatter(output, input, op), async_op)

    def all_gather(self, output, input, async_op=False):
        """output = concat over ranks of input (flat, rank order)."""
        if output.numel() != input.numel() * self.size or input.dtype != output.dtype:
            raise ValueError(f"all_gather: output {tuple(output.shape)} {output.dtype} must hold "
                             f"{self.size} x input {tuple(input.shape)} {input.dtype}")
        self._enter("all_gather", output, input)
        return self._run("all_gather", self._nbytes(output),
                         lambda: self._impl.all_gather(output, input), async_op)

    def broadcast(self, tensor, src=0, async_op=False):
        self._check_rank("broadcast", src)
        self._enter("broadcast", tensor)
        return self._run("broadcast", self._nbytes(tensor),
                         lambda: self._impl.broadcast(tensor, src), async_op)

    @torch.no_grad()
    def broadcast_tensors(self, tensors, src=0):
        """Rank `src`'s values of many tensors (buffers, frozen weights): one broadcast per dtype of
        all of them packed flat (as torch DDP coalesces its buffer broadcast), copied back in place.
        Counted as one broadcast of their total bytes, (N-1)/N·S sent per rank."""
        by_dtype = {}
        for t in tensors:
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group]).to(self.device)
            self.broadcast(flat, src=src)
            for t, part in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(part.view(t.shape))

    def reduce(self, tensor, dst=0, op="sum", async_op=False):
        self._check_op("reduce", op)
        self._check_rank("reduce", dst)
        self._enter("reduce", tensor)
        return self._run("reduce", self._nbytes(tensor),
                         lambda: self._impl.reduce(tensor, dst, op), async_op)

    def all_to_all(self, output, input, async_op=False):
        """Chunk j of `input` goes to rank j; chunk j of `output` came from rank j."""
        if (
            input.numel() != output.numel()
            or input.numel() % self.size
            or input.dtype != output.dtype
        ):
            raise ValueError(f"all_to_all: input {tuple(input.shape)} and output "
                             f"{tuple(output.shape)} must have equal size divisible by {self.size} "
                             "and one dtype")
        self._enter("all_to_all", output, input)
        return self._run("all_to_all", self._nbytes(input),
                         lambda: self._impl.all_to_all(output, input), async_op)

    def send(self, tensor, dst, tag=0):
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor, src, tag=0):
        self.irecv(tensor, src, tag).wait()

    def isend(self, tensor, dst, tag=0):
        self._check_rank("send", dst)
        self._enter("send", tensor, check=False)
        self._count("send", self._nbytes(tensor), peer=dst)
        with label("mz.send"):
            work = self._impl.isend(tensor, dst, tag)
        peer = f"{dst} of {self.name}{self._job_rank(dst)}"
        work._op = f"send to rank {peer} ({self._nbytes(tensor)} B)"
        heartbeat.beat(f"idle (in flight: {work._op})")
        return work

    def irecv(self, tensor, src, tag=0):
        self._check_rank("recv", src)
        self._enter("recv", tensor, check=False)
        self._count("recv", self._nbytes(tensor))
        with label("mz.recv"):
            work = self._impl.irecv(tensor, src, tag)
        peer = f"{src} of {self.name}{self._job_rank(src)}"
        work._op = f"recv from rank {peer} ({self._nbytes(tensor)} B)"
        heartbeat.beat(f"idle (in flight: {work._op})")
        return work

    def barrier(self, sleep_s: float | None = None):
        """Wait until every rank of this group arrives. Counted as one barrier call, 0 bytes sent.
        sleep_s: wait by polling, sleeping sleep_s seconds between polls, instead of in the
        backend's own barrier (MPICH's busy-polls a core: with more ranks than cores, a rank that
        arrived early takes the CPU from the ranks still computing). gloo's barrier sleeps
        already."""
        heartbeat.beat(f"barrier on {self.name}")
        self._count("barrier", 0)
        if sleep_s is None:
            self._impl.barrier()
        else:
            work = self._impl.ibarrier()
            work._op = f"barrier on {self.name}"
            work.wait(sleep_s=sleep_s)
        heartbeat.beat("idle (last: barrier)")

    def allgather_object(self, obj):
        """Small Python objects (pickled); not counted: metadata, not training traffic."""
        heartbeat.beat(f"allgather_object on {self.name}")
        out = self._impl.allgather_obj(obj)
        heartbeat.beat("idle (last: allgather_object)")
        return out

    def check_replicated(self, named_tensors, who: str):
        """Raise if any tensor differs between ranks. A debug aid for wrappers that assume every
        rank built the same model (one small all-gather of hashes, not of the tensors)."""
        import hashlib
        mine = [(n, tuple(t.shape),
                 hashlib.sha1(t.detach().float().cpu().numpy().tobytes()).hexdigest())
                for n, t in named_tensors]
        for r, theirs in enumerate(self.allgather_object(mine)):
            bad = [a[0] for a, b in zip(theirs, mine) if a != b] + (
                [] if len(theirs) == len(mine) else ["(count)"]
            )
            if bad:
                raise ValueError(f"{who}(debug=True): parameter {bad[0]!r} differs between rank "
                                 f"{self.rank} and rank {r} at construction. Each rank wraps its "
                                 "OWN copy, so the ranks would train different (or mixed) models: "
                                 "build it with the same seed everywhere.")

    def _job_rank(self, r) -> str:
        """' (job rank J)' when member r of this group is rank J of the job and J != r, else '': a
        timeout's report names every rank by its job rank (its heartbeat file's)."""
        c, job = self, r
        while c.parent is not None and c.parent_ranks is not None:
            job, c = c.parent_ranks[job], c.parent
        return f" (job rank {job})" if job != r else ""

    def _check_rank(self, op, r):
        if not 0 <= r < self.size:
            raise ValueError(f"{op}: rank {r} out of range for {self.name} of size {self.size}")

    # -- groups
    def split(self, color: int, key: int | None = None, name: str | None = None) -> "Communicator":
        """Ranks with the same `color` form a sub-communicator, ordered by `key` (default: rank).
        Every rank must call it (like MPI_Comm_split)."""
        key = self.rank if key is None else key
        impl = self._impl.split(color, key)
        sub = Communicator(self.backend, impl, self.device, name or f"{self.name}/{color}",
                           parent=self, debug=self.debug)
        sub.parent_ranks = impl.allgather_obj(self.rank)  # metadata, once: who is who in the parent
        return sub

    def new_group(self, ranks, name: str | None = None) -> "Communicator | None":
        """A sub-communicator of `ranks` (ranks of this communicator). All ranks call it;
        non-members get None."""
        ranks = sorted(ranks)
        for r in ranks:
            self._check_rank("new_group", r)
        inside = self.rank in ranks
        sub = self.split(0 if inside else 1, name=name or f"{self.name}/{ranks}")
        return sub if inside else None

    def require_size(self, n: int, why: str = ""):
        if self.size != n:
            raise RuntimeError(f"this needs {n} ranks{' (' + why + ')' if why else ''} but runs on "
                               f"{self.size}: launch with `mpirun -n {n} ...` or launch.run(..., "
                               f"nprocs={n})")


_WORLD: Communicator | None = None


def init(backend: str | None = None, debug: bool | None = None) -> Communicator:
    """The global communicator (created on first call). Under mpirun on CPU: mpi backend."""
    global _WORLD
    if _WORLD is not None:
        if backend is not None and backend != _WORLD.backend:
            raise RuntimeError(f"communicator already initialized with backend {_WORLD.backend!r}")
        return _WORLD
    # a bad MINIZERO_* variable: one line (launched rank 0's) and exit 2 on every rank of a job,
    # before any rank meets another; a single process gets the EnvError itself
    if launched_world_size() > 1:
        mz_env.check_or_exit()
    else:
        mz_env.check()
    backend, device = select_backend_and_device(backend)
    if backend == "mpi":
        # MINIZERO_MPI_STAGE=1: stage CPU tensors through a host copy too, as CUDA tensors always
        # are (several ranks on one GPU): the GPU check's --quick run takes that path on CPU
        impl = MPIBackend(mpi_module().COMM_WORLD, stage_all=mz_env.get("MINIZERO_MPI_STAGE"))
    else:
        import torch.distributed as dist
        # we start it, so we end it: gloo aborts a process left with it
        if not dist.is_initialized():
            init_torch_distributed(device)
            atexit.register(shutdown)
        impl = TorchBackend()
    _WORLD = Communicator(backend, impl, device, debug=debug)
    # a peer that dies mid-collective: one line on a survivor, not its traceback
    if _WORLD.size > 1:
        sys.excepthook = report_rank_lost
    return _WORLD


def init_torch_beside(world: Communicator):
    """Start torch.distributed beside `world` if it does not run yet, with the same rank and size,
    as DeepSpeed's init_distributed always does: its programs call torch.distributed themselves
    (rank checks, barriers, metric all-reduces). `world`'s own collectives keep their backend (mpi
    under mpirun on CPU) and their byte counts. Several ranks on one GPU share it through the mpi
    backend, which NCCL refuses: there torch gets gloo."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    init_torch_distributed(torch.device("cpu") if world.backend == "mpi" else world.device)
    failed = []
    chained = sys.excepthook

    def hook(*exc):  # a rank dying of an exception must not wait at shutdown's barrier
        failed.append(True)
        chained(*exc)

    def leave():
        # mpi4py finalizes MPI after every atexit handler: gloo's pairs close first, after the
        # barrier of shutdown() on a normal exit, so that no rank tears them down under a peer still
        # using them
        if failed and dist.is_initialized():
            dist.destroy_process_group()
        shutdown()

    sys.excepthook = hook
    atexit.register(leave)


def is_initialized() -> bool:
    """Whether the global communicator exists (without creating it)."""
    return _WORLD is not None


def get() -> Communicator:
    """The global communicator; initializes it with defaults if needed."""
    return _WORLD if _WORLD is not None else init()


def shutdown():
    """Tear down the global communicator (and torch.distributed, if we started it)."""
    global _WORLD
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
            # a rank that tears gloo down while a peer still uses its pairs aborts that peer
            # ("terminate called without an active exception", seen under load at exit): meet first,
            # but never wait long for a peer that already failed (torchrun then ends the job with
            # that rank's error)
            from datetime import timedelta
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=SHUTDOWN_BARRIER_S))
            except RuntimeError:
                pass
        dist.destroy_process_group()
    _WORLD = None


SHUTDOWN_BARRIER_S = 30  # how long a rank leaving a gloo job waits for the others at exit
