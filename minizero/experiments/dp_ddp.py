"""minizero.experiments.dp_ddp: what lesson 02 measures about data parallelism.

The workers run on every rank through `minizero.launch.run`:
  * `check_equal`  : DDP (each mode) vs one process on the whole batch vs torch's
                     DistributedDataParallel, and `no_sync` accumulation vs one bigger batch;
  * `time_modes`   : step time of naive / bucketed / overlapped DDP, split into compute
                     (forward + backward) and exposed communication (finish), messages and
                     bytes per step, and a timeline of one overlapped step;
  * `time_data_parallel` (one process): the old single-process DataParallel, by phase.

Timing rules (as in experiments/collectives.py): every step starts after a barrier, a step is done when its
slowest rank is, and we report the median over steps. Nothing here changes what DDP does:
`TimedComm` (experiments/timed_comm.py) only wraps the communicator to note the clock when an
all-reduce is launched and when its wait() begins and returns.
"""
from __future__ import annotations

import statistics
import time

import torch

from minizero.experiments.references import train_single
from minizero.data import shard
from minizero.dp.data_parallel import DataParallel
from minizero.dp.ddp import DDP
from minizero.models import build_model
from minizero.experiments.references import flat_params, global_batches, train_torch_ddp
from minizero.experiments import sleepy_barrier
from minizero.experiments.loops import ddp as ddp_loop  # noqa: F401 - a job of `several`
from minizero.experiments.timed_comm import TimedComm

# Timing model: 3.2 M parameters (12.8 MB of fp32 gradients in 53 tensors). With 2 sequences
# of 32 tokens per rank, backward takes tens of ms on one core, the all-reduce of 12.8 MB a
# few ms: the regime where how communication is scheduled shows in the step time.
BENCH_GPT = dict(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=256)
# Equality model: the small tied GPT of tests/test_ddp.py (fast, and a tied weight).
SMALL_GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)


# ----------------------------------------------------------------------------- equality
def _max_diff(a, b):
    return (a - b).abs().max().item()


def check_equal(comm, steps=3, global_batch=12, lr=0.1, bucket_numel=5000, micro=2, torch_group=None):
    """SGD steps of SMALL_GPT with each DDP mode; rank 0 also trains one process on the whole
    batch. Then `micro` micro-batches under no_sync vs one step on all of them at once.
    torch_group: the torch.distributed group of comm's ranks when comm is not the world."""
    out = {"N": comm.size}
    runs = {}
    for mode in ("naive", "bucketed", "overlap"):
        model = build_model("tiny-gpt", seed=0, **SMALL_GPT)
        ddp = DDP(model, comm, mode=mode, bucket_numel=None if mode == "naive" else bucket_numel)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        for x, y in global_batches(model, steps, global_batch):
            ddp(*shard((x, y), comm.rank, comm.size))[1].backward()
            ddp.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs[mode] = flat_params(model)
    torch_ddp = torch.tensor(train_torch_ddp(comm, "tiny-gpt", steps, global_batch, lr,
                                             model_kwargs=SMALL_GPT, process_group=torch_group)["params"])
    # no_sync: micro-batches accumulate locally, one all-reduce at the last one.
    model = build_model("tiny-gpt", seed=0, **SMALL_GPT)
    ddp = DDP(model, comm, mode="overlap", bucket_numel=bucket_numel)
    batches = global_batches(model, micro, global_batch)
    comm.stats.reset()
    sent = []
    for i, batch in enumerate(batches):
        loss = ddp(*shard(batch, comm.rank, comm.size))[1] / micro  # mean over all micro-batches
        if i < micro - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
            ddp.finish_gradient_synchronization()
        sent.append(comm.stats.sent())
    torch.optim.SGD(model.parameters(), lr=lr).step()
    out["no_sync_sent"] = sent  # cumulative bytes after each micro-batch
    out["psi"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if comm.rank == 0:
        single = build_model("tiny-gpt", seed=0, **SMALL_GPT)
        train_single(single, torch.optim.SGD(single.parameters(), lr=lr, momentum=0.9),
                     global_batches(single, steps, global_batch))
        ref = flat_params(single)
        out["vs_single"] = {m: _max_diff(p, ref) for m, p in runs.items()}
        out["vs_single"]["torch DDP"] = _max_diff(torch_ddp, ref)
        out["vs_torch"] = {m: _max_diff(p, torch_ddp) for m, p in runs.items()}
        out["bitwise_torch"] = {m: torch.equal(p, torch_ddp) for m, p in runs.items()}
        big = build_model("tiny-gpt", seed=0, **SMALL_GPT)
        both = tuple(torch.cat(parts) for parts in zip(*batches))
        train_single(big, torch.optim.SGD(big.parameters(), lr=lr), [both])
        out["no_sync_vs_big_batch"] = _max_diff(flat_params(model), flat_params(big))
        out["param_scale"] = flat_params(big).abs().max().item()
    return out


# ----------------------------------------------------------------------------- timing
def _slowest_median(comm, values, best=False):
    """Per step, the slowest rank's value; then the median (or the minimum) over steps."""
    slowest = [max(vs) for vs in zip(*comm.allgather_object(values))]
    return min(slowest) if best else statistics.median(slowest)


def time_modes(comm, modes=("naive", "bucketed", "overlap"), steps=8, warmup=2, bucket_numel=250_000,
               batch_per_rank=2, model_kwargs=None, timeline_mode="overlap"):
    """Per mode: medians of compute (forward+backward), finish (exposed communication) and the
    whole step; all_reduce messages and bytes per step (comm.stats); and, for `timeline_mode`,
    this rank's timeline of its last step, in seconds from the start of backward: when each
    gradient was ready, and when each bucket's all-reduce was launched and its wait() began and
    returned. (When the bytes actually moved, no clock here can see: see progress_probe.)"""
    torch.set_num_threads(1)
    cfg = dict(BENCH_GPT, **(model_kwargs or {}))
    out = {"N": comm.size, "modes": {}}
    for mode in modes:
        model = build_model("tiny-gpt", seed=0, **cfg)
        timed = TimedComm(comm, time.perf_counter)
        ddp = DDP(model, timed, mode=mode, bucket_numel=None if mode == "naive" else bucket_numel)
        params = ddp.params
        ready = {}

        def note(i):
            def hook(p):
                ready.setdefault(i, time.perf_counter())  # a hook must return None
            return hook
        for i, p in enumerate(params):  # registered after DDP's hooks: they run after them
            p.register_post_accumulate_grad_hook(note(i))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        batches = global_batches(model, warmup + steps, batch_per_rank * comm.size)
        compute, finish, step, msgs, sent = [], [], [], [], []
        for k, batch in enumerate(batches):
            x, y = shard(batch, comm.rank, comm.size)
            ready.clear()
            timed.records.clear()
            comm.barrier()
            comm.stats.reset()
            t0 = time.perf_counter()
            loss = ddp(x, y)[1]
            tb = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            ddp.finish_gradient_synchronization()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if k >= warmup:
                compute.append(t1 - t0)
                finish.append(t2 - t1)
                step.append(t3 - t0)
                msgs.append(comm.stats.ops["all_reduce"].calls if "all_reduce" in comm.stats.ops else 0)
                sent.append(comm.stats.sent())
        row = {"compute": _slowest_median(comm, compute), "finish": _slowest_median(comm, finish),
               "step": _slowest_median(comm, step), "messages": statistics.median_low(msgs),
               "sent": statistics.median_low(sent), "buckets": len(ddp.buckets),
               "psi": sum(p.numel() for p in params)}
        if mode == timeline_mode:
            rel = lambda t: t - tb  # noqa: E731
            row["timeline"] = {
                "forward_start": rel(t0), "backward_end": rel(t1), "finish_end": rel(t2),
                "grad_ready": sorted(rel(t) for t in ready.values()),
                "all_reduce": [{"bytes": r["bytes"],
                                **{k: rel(r[k]) for k in ("launch", "launched", "wait_start", "done")}}
                               for r in timed.records if r["op"] == "all_reduce"]}
        out["modes"][mode] = row
    return out


def progress_probe(comm, nbytes=4_000_000, compute_s=0.05, repeats=5):
    """Does a nonblocking all-reduce make progress while this rank computes and calls no MPI?

    Times (slowest rank; median, and the minimum over repeats as "best_..."): a blocking
    all_reduce of `nbytes`; `compute_s` of matmuls alone; and the overlapped version: launch
    the all_reduce async, compute as long, then wait(). If the library progresses in the
    background, that wait() is ~0; if it only progresses inside MPI calls (MPICH's default),
    the wait() is the whole all-reduce. The process's OS thread count shows whether MPICH
    started a progress thread (MPICH_ASYNC_PROGRESS=1)."""
    torch.set_num_threads(1)
    buf = torch.ones(nbytes // 4)
    a = torch.randn(128, 128)

    def compute():  # matmuls for compute_s of wall time; no MPI call in here
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < compute_s:
            a @ a
    rows = {"all_reduce": [], "compute": [], "overlapped": [], "wait": []}
    for _ in range(repeats + 1):  # the first round is a warm-up
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(buf)
        rows["all_reduce"].append(time.perf_counter() - t0)
        comm.barrier()
        t0 = time.perf_counter()
        compute()
        rows["compute"].append(time.perf_counter() - t0)
        comm.barrier()
        t0 = time.perf_counter()
        work = comm.all_reduce(buf, async_op=True)
        compute()
        t1 = time.perf_counter()
        work.wait()
        t2 = time.perf_counter()
        rows["overlapped"].append(t2 - t0)
        rows["wait"].append(t2 - t1)
    return ({k: _slowest_median(comm, v[1:]) for k, v in rows.items()}
            | {f"best_{k}": _slowest_median(comm, v[1:], best=True) for k, v in rows.items()}
            | {"nbytes": nbytes, "os_threads": _os_threads()})


def _os_threads():
    """Threads of this process as the OS sees them (MPICH's progress thread is one of them)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("Threads:")))
    except (OSError, StopIteration):
        return None


def several(comm, jobs: dict):
    """Run several of this module's workers in one launch (a launch costs seconds):
    jobs = {"label": ["function name", {kwargs}]} -> {"label": result}."""
    return {label: globals()[name](comm, **kwargs) for label, (name, kwargs) in jobs.items()}


def lesson(comm, small_jobs: dict, world_jobs: dict, small: int = 2):
    """Lesson 02's measurements with MPICH's default in ONE launch (a launch costs seconds, more
    on a busy machine): `small_jobs` on ranks 0..small-1 (a sub-communicator; the other ranks
    sleep meanwhile instead of spinning, so the small group has the cores), then `world_jobs` on
    every rank. A "probe" job runs before torch.distributed starts, whose gloo threads it would
    count. Jobs as in `several`. -> {"small": results (ranks < small), "world": results}."""
    import torch.distributed as dist
    from minizero.comm import init_torch_distributed
    sub = comm.split(0 if comm.rank < small else 1, name=f"first{small}")
    out = {"small": {}}
    first = {k: v for k, v in small_jobs.items() if v[0] == "progress_probe"}
    if comm.rank < small:
        out["small"] = several(sub, first)
    sleepy_barrier()
    init_torch_distributed(torch.device("cpu"))  # every rank: new_group is collective
    torch_group = dist.new_group(list(range(small)))
    if comm.rank < small:
        rest = {k: [name, dict(kw, torch_group=torch_group) if name == "check_equal" else kw]
                for k, (name, kw) in small_jobs.items() if k not in first}
        out["small"].update(several(sub, rest))
    sleepy_barrier()
    out["world"] = several(comm, world_jobs)
    return out


def time_data_parallel(comm, replicas=(1, 2, 4), steps=6, warmup=1, batch_per_replica=2, model_kwargs=None):
    """One process, n replicas (the nn.DataParallel idea). Per n: median seconds of each phase
    of a step, and the bytes that flow into replica 0 (the other replicas' gradients) and out
    of it (its weights and buffers, copied to every other replica), counted from the tensors."""
    torch.set_num_threads(1)
    cfg = dict(BENCH_GPT, **(model_kwargs or {}))
    rows = []
    for n in replicas:
        dp = DataParallel(build_model("tiny-gpt", seed=0, **cfg), n)
        opt = torch.optim.SGD(dp.parameters(), lr=1e-3)
        phases = {k: [] for k in ("forward", "backward", "reduce", "optimizer", "sync")}
        for k, (x, y) in enumerate(global_batches(dp.module, warmup + steps, batch_per_replica * n)):
            t = [time.perf_counter()]
            loss = dp(x, y)[1]
            t.append(time.perf_counter())
            loss.backward()
            t.append(time.perf_counter())
            into0 = sum(p.grad.numel() * p.grad.element_size()
                        for r in dp.replicas[1:] for p in r.parameters() if p.grad is not None)
            dp.reduce_gradients()
            t.append(time.perf_counter())
            opt.step()
            opt.zero_grad(set_to_none=True)
            t.append(time.perf_counter())
            dp.sync_replicas()
            t.append(time.perf_counter())
            out0 = sum(v.numel() * v.element_size() for r in dp.replicas[1:]
                       for v in [*r.parameters(), *r.buffers()])
            if k >= warmup:
                for name, a, b in zip(phases, t, t[1:]):
                    phases[name].append(b - a)
        med = {k: statistics.median(v) for k, v in phases.items()}
        rows.append({"replicas": n, **med, "step": sum(med.values()),
                     "bytes_into_replica0": into0, "bytes_out_of_replica0": out0})
    return rows
