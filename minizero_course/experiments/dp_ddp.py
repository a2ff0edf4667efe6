"""minizero_course.experiments.dp_ddp: what lesson 02 measures about data parallelism.

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

from minizero_course.experiments.references import train_single
from minizero.data import shard
from minizero.dp.data_parallel import DataParallel
from minizero.dp.ddp import DDP
from minizero.models import build_model
from minizero_course.experiments.references import flat_params, global_batches, train_torch_ddp
from minizero_course.experiments import sleepy_barrier
from minizero_course.experiments.collectives import pingpong  # noqa: F401 - a job of `several` (one message's latency)
from minizero_course.experiments.loops import ddp as ddp_loop  # noqa: F401 - a job of `several`
from minizero_course.experiments.timed_comm import TimedComm

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


# ----------------------------------------------------------------------------- what the run says
# Lesson 02's conclusions, written from plain numbers (seconds, bytes, ratios): one sentence for
# each side of every comparison, so that a loaded machine prints what happened, not what should have.
def _vs_n(ratio: float, n: int) -> str:
    """A serial run of n replicas against n times one replica."""
    if abs(ratio / n - 1) <= 0.25:
        return f"about {n}×, as one-after-another predicts"
    return f"more than {n}×: each phase also waited for a core" if ratio > n else f"less than {n}×"


def describe_data_parallel(f: dict) -> str:
    """DataParallel (one process, n replicas) against DDP; f: one (s, a lone replica's forward+backward),
    serial {2, 4} (forward+backward vs one), step {2, 4} (whole step vs one replica's), ddp_compute {2, 4},
    ddp_step2, dp_step2, ddp_comm2 (DDP's step minus its compute), dp_copies2 (reduce + sync), bytes_into {2, 4},
    ddp_sent4, psi, load, cores."""
    def ms(t):
        return f"{t * 1e3:.1f} ms"
    c2, c4 = f["ddp_compute"][2], f["ddp_compute"][4]
    s = ("* **Step time.** One process computes the replicas one after another, so n replicas cost n times one "
         f"replica's forward and backward ({ms(f['one'])} here) if nothing else changes. Measured: forward and "
         f"backward took {f['serial'][2]:.1f}× as long with 2 replicas ({_vs_n(f['serial'][2], 2)}) and "
         f"{f['serial'][4]:.1f}× with 4 ({_vs_n(f['serial'][4], 4)}); the whole step {f['step'][2]:.1f}× and "
         f"{f['step'][4]:.1f}× (the reduction into replica 0 and the copies back out come on top; load average up to "
         f"{f['load']:.1f} on {f['cores']} cores). DDP with N=2 ranks computed for {ms(c2)} per step "
         f"({c2 / f['one']:.1f}× one replica alone, on the same per-replica batch): ")
    if c2 > 1.25 * f["one"]:
        s += "slower than a lone replica, since the two ranks compete for the cores. "
    elif c2 < 0.8 * f["one"]:
        s += ("faster than a lone replica, which running in parallel cannot explain (each rank "
              "does a lone replica's work): the two were timed at different moments of a shared "
              "machine, so this is noise. ")
    else:
        s += ("about a lone replica's time, as ranks running in parallel on their own cores "
              "should take. ")
    if f["cores"] < 4:
        s += f"With N=4 on {f['cores']} cores DDP is oversubscribed (two ranks per core), and its compute "
        s += (f"grew to {ms(c4)}." if c4 > 1.1 * c2 else
              f"did not grow: {ms(c4)} against {ms(c2)} at N=2 (each rank's share of the batch is the same, and the "
              "two timings came from different moments of a shared machine).")
    d, p = f["ddp_step2"], f["dp_step2"]
    s += f" Overall DDP's step was {ms(d)} at N=2 against {ms(p)} for 2 replicas: "
    if abs(d / p - 1) <= 0.05:
        s += "about the same (within 5%)."
    elif d < p:
        s += "DDP was faster."
    else:
        why = []
        if c2 > 1.3 * f["one"]:
            why.append(f"each DDP rank computed {c2 / f['one']:.1f}× slower than a lone replica: two processes compete "
                       f"for the cores (with each other and with other programs)")
        if f["ddp_comm2"] > f["dp_copies2"]:
            why.append(f"its communication and optimizer took {ms(f['ddp_comm2'])}, more than DataParallel's reduce "
                       f"and sync ({ms(f['dp_copies2'])}), which are plain copies inside one process")
        s += "DDP was not faster here" + (": " + "; and ".join(why) + "." if why else
                                          ", and neither its compute nor its communication alone explains it: noise.")
    s += (" On GPUs, where each replica has its own device, `DataParallel`'s serial Python driving and its hub are "
          "what stop it scaling.")
    hub = f["bytes_into"][4] / f["ddp_sent4"]
    s += (f"\n* **The hub.** Into replica 0 flow {f['bytes_into'][2] / 1e6:.1f} MB per step with 2 replicas and "
          f"{f['bytes_into'][4] / 1e6:.1f} MB with 4, $(n-1)\\Psi\\cdot 4$ bytes, and as much flows back out as "
          f"weights. A DDP rank at N=4 sent {f['ddp_sent4'] / 1e6:.1f} MB, {hub:.1f}× less than replica 0 receives, "
          f"and that stays under $2\\Psi\\cdot4$ = {8 * f['psi'] / 1e6:.1f} MB at any N while the hub's load grows "
          "with n.")
    return s


def describe_modes(f: dict) -> str:
    """Naive, bucketed and overlapped DDP; f: m = {N: {mode: {messages, sent, compute, finish, step}}} for N = 2, 4,
    psi, alpha (lesson 01's ping-pong latency on an idle machine, seconds), load."""
    m, ms = f["m"], (lambda t: f"{t * 1e3:.1f} ms")
    extra = {N: m[N]["naive"]["messages"] - m[N]["bucketed"]["messages"] for N in m}
    per_msg = {N: (m[N]["naive"]["finish"] - m[N]["bucketed"]["finish"]) / extra[N] for N in m}
    out = [f"* **Same bytes, different messages.** Every mode sent exactly {m[2]['naive']['sent'] / 1e6:.2f} MB per "
           f"rank per step at N=2 and {m[4]['naive']['sent'] / 1e6:.2f} MB at N=4, the ring's "
           f"$2\\frac{{N-1}}{{N}}\\Psi\\cdot4$. Naive "
           f"needs {m[2]['naive']['messages']} messages, the buckets {m[2]['bucketed']['messages']}."]
    s = (f"* **Naive vs bucketed.** At N=2 naive's `finish` took {ms(m[2]['naive']['finish'])} against bucketed's "
         f"{ms(m[2]['bucketed']['finish'])}; at N=4, {ms(m[4]['naive']['finish'])} against "
         f"{ms(m[4]['bucketed']['finish'])}. ")
    s += f"A message's latency α is {f['alpha'] * 1e6:.0f} µs here (lesson 01's ping-pong, rerun in this job). "
    for N in m:
        if per_msg[N] <= 0:
            s += (f"At N={N} naive was not slower: with few timed steps on a busy machine the noise is larger than "
                  f"what {extra[N]} extra messages cost. ")
        else:
            s += (f"At N={N} each extra message cost {per_msg[N] * 1e6:.0f} µs, " +
                  ("the order of α. " if per_msg[N] < 4 * f["alpha"] else f"{per_msg[N] / f['alpha']:.0f}× α. "))
    if any(per_msg[N] >= 4 * f["alpha"] for N in m):
        s += ("A blocking all-reduce costs more than its message because it is also a rendezvous: it waits until every "
              "rank has reached it, and a rank that is not running then (other programs: load average "
              f"{f['load']:.1f}; or a second rank on its core) makes all of them wait. ")
    if per_msg[2] > 0 and per_msg[4] > 3 * per_msg[2]:
        s += (f"A message cost {per_msg[4] / per_msg[2]:.0f}× more at N=4 than at N=2: with two ranks per core, every "
              "blocking all-reduce waits until all four ranks have been scheduled, and naive pays that wait once per "
              "tensor. Buckets are launched together and waited for together, so the wait is paid about once. ")
    elif per_msg[2] > 0 and per_msg[4] > 0:
        s += f"A message cost {per_msg[4] / per_msg[2]:.1f}× as much at N=4 as at N=2. "
    s += f"(Bucketed also pays for copying {4 * f['psi'] / 1e6:.1f} MB into the buckets inside `finish`.)"
    out.append(s)
    o2, b2, o4, b4 = m[2]["overlap"], m[2]["bucketed"], m[4]["overlap"], m[4]["bucketed"]
    def verdict(o, b):
        return "faster" if o["step"] < b["step"] else "no faster"
    out.append(f"* **Overlapped vs bucketed.** Overlap moves the copies and the launches *into* backward: its "
               f"forward+backward took {ms(o2['compute'])} against {ms(b2['compute'])} at N=2, and its `finish` "
               f"{ms(o2['finish'])} against {ms(b2['finish'])}. The whole step: {ms(o2['step'])} against "
               f"{ms(b2['step'])}, {verdict(o2, b2)} at N=2; at N=4 {ms(o4['step'])} against {ms(b4['step'])}, "
               f"{verdict(o4, b4)}. "
               "Whether the all-reduces really ran *during* backward is not visible in these totals. Section 4 looks "
               "inside one step.")
    return "\n".join(out)


def timeline_waits(tl: dict) -> dict:
    """From one overlapped step's timeline: seconds rank 0 was blocked in wait() (all, and the first wait
    alone), and how many of the buckets were launched before backward ended."""
    waits = [r["done"] - r["wait_start"] for r in tl["all_reduce"]]
    return {"blocked": sum(waits), "first": waits[0], "buckets": len(waits),
            "launched": sum(r["launch"] < tl["backward_end"] for r in tl["all_reduce"])}


def describe_progress(f: dict) -> str:
    """Section 4's verdict: did the communication overlap? f: pd / pa = progress_probe results without / with
    MPICH_ASYNC_PROGRESS, nbytes and compute_s (the probe's), default / threaded = timeline_waits(...) plus the
    overlapped step's compute and step (seconds), cores, load."""
    pd, pa, d, t = f["pd"], f["pa"], f["default"], f["threaded"]
    def ms(x):
        return f"{x * 1e3:.2f} ms"
    def hidden(p):
        return float(min(max(1 - p["best_wait"] / p["best_all_reduce"], 0), 1))
    out = ["**What we measured.**", ""]
    s = (f"* **The probe, MPICH default.** A blocking {f['nbytes'] / 1e6:.0f} MB all-reduce took "
         f"{ms(pd['best_all_reduce'])}. Launched async before {f['compute_s'] * 1e3:.0f} ms of compute, its `wait()` "
         f"still took {ms(pd['best_wait'])} "
         "afterwards: ")
    s += ("**no background progress**; the all-reduce ran inside `wait()`, after the compute, as if it had never been "
          "launched early." if hidden(pd) < 0.5 else f"about {hidden(pd):.0%} of it was done before the wait.")
    if pd["best_wait"] > pd["best_all_reduce"]:
        s += (" (The wait even exceeds the blocking all-reduce: it also absorbs the other rank arriving late from its "
              "compute.)")
    out.append(s)
    s = (f"* **The probe, `MPICH_ASYNC_PROGRESS=1`.** Each rank now has {pa['os_threads']} OS threads instead of "
         f"{pd['os_threads']}{': the progress thread exists' if pa['os_threads'] > pd['os_threads'] else ''}. The wait "
         f"took {ms(pa['best_wait'])} after the compute, against a blocking all-reduce of "
         f"{ms(pa['best_all_reduce'])}: ")
    s += (f"about {hidden(pa):.0%} of the all-reduce happened during the compute." if hidden(pa) >= 0.5 else
          "the thread did not get the all-reduce done during the compute.")
    ratio = pa["best_all_reduce"] / pd["best_all_reduce"]
    s += (f" The blocking all-reduce itself took {ratio:.1f}× as long as without the thread"
          + (f": two busy-polling threads and two ranks share {f['cores']} cores." if ratio > 1.5 else "."))
    out.append(s)
    s = (f"* **The timeline, MPICH default.** {d['launched']} of {d['buckets']} buckets were launched during backward"
         + (", as designed" if d["launched"] == d["buckets"]
            else ", fewer than designed (the rest when backward was over)")
         + f", and rank 0 then sat {d['blocked'] * 1e3:.1f} ms blocked in `wait()` after backward, "
         f"{d['first'] * 1e3:.1f} ms "
         "of it in the **first** wait. A timeline sees when `wait()` returns, not when the bytes moved; the probe says "
         "where they moved. Any MPI call runs MPICH's progress engine for *every* pending request, so one long wait "
         "can complete the later buckets too, and their own waits return at once. The same rule gives the default "
         "MPICH its only overlap: each launch is an MPI call, so it advances the all-reduces already pending a little, "
         "between two layers' gradients (exercise 3 makes use of that).")
    out.append(s)
    out.append(f"* **The timeline, async progress.** {t['launched']} of {t['buckets']} buckets were launched during "
               f"backward, and rank 0 was blocked for {t['blocked'] * 1e3:.1f} ms in `wait()` ({t['first'] * 1e3:.1f} "
               f"ms in the first). Its forward+backward took {t['compute'] * 1e3:.1f} ms, against "
               f"{d['compute'] * 1e3:.1f} ms without the thread, and a whole overlapped step {t['step'] * 1e3:.1f} ms "
               f"against {d['step'] * 1e3:.1f} ms. "
               + ("The progress threads cost more than the overlap saved." if t["step"] > d["step"] else
                  "Here the overlap paid for the thread."))
    out.append("")
    s = ("So on this CPU, with MPICH's default, overlapped DDP **launches early but communicates late**: the bytes "
         "move inside `wait()`." if hidden(pd) < 0.5 else
         f"With MPICH's default, {hidden(pd):.0%} of the probe's all-reduce was done before its wait: more than "
         "MPICH's rule predicts.")
    s += f" The progress thread moved {hidden(pa):.0%} of it in the background"
    if hidden(pa) < 0.5:
        s += (f", not more, because it competed for the {f['cores']} cores with the ranks (and other programs: load "
              f"average {f['load']:.1f}).")
    # what the thread is for: the same launch + compute + wait finishing sooner than without it
    elif pa["best_overlapped"] < pd["best_overlapped"]:
        s += (f", and that saved time: launch + compute + wait took {ms(pa['best_overlapped'])} with the thread "
              f"against {ms(pd['best_overlapped'])} without it.")
    else:
        s += (f", yet saved no time: launch + compute + wait took {ms(pa['best_overlapped'])} with the thread against "
              f"{ms(pd['best_overlapped'])} without it (the compute alone {ms(pa['best_compute'])} against "
              f"{ms(pd['best_compute'])}, the blocking all-reduce {ratio:.1f}× as long).")
    slower = t["step"] / d["step"]
    s += (f" It busy-polls a core, and 2 ranks plus 2 threads on {f['cores']} cores made the overlapped DDP step "
          f"{slower:.1f}× {'slower' if slower > 1 else 'faster'}."
          + (" A progress thread pays only when it has a spare core." if slower > 1 else ""))
    out.append(s)
    return "\n".join(out)
