"""Lab 02 checks: bucketed DDP, overlapped with backward (minizero/dp/ddp.py's marked regions).

Students write Bucket.fill (gradient -> slot of a flat bucket), the overlap branch of the grad
hook (fill, then launch every full bucket in order) and the bucketed part of
finish_gradient_synchronization (launch the rest, wait, divide by N, p.grad = bucket view).

One launch per N (2 and 3) trains the student's DDP and minizero's reference DDP side by side
and torch's DistributedDataParallel; the first four checks read that one result (cached), so they
cost two launches and an untouched lab fails each of them within one fast launch. The fifth
launches its own 2-rank job: ranks that produce gradients in opposite orders and use different
parameters (RankDependent), under MINIZERO_DEBUG, so that ranks launching different buckets fail
with a clear message instead of hanging or adding the wrong buckets; a job of its own, so that a
deadlock there costs only that check's points.
The bucketed mode runs first, so a student meets the TODOs in a workable order: finish (bucketed),
then Bucket.fill (which finish calls), then the overlap hook.

Tolerances (tests/test_ddp.py measures them): SGD with momentum, rtol 1e-6 and atol 2e-7 against
the reference DDP and torch DDP. The student's buckets are the reference's (bucket layout is not
part of the lab) and the all-reduce is the same call, so an exact implementation is bitwise equal
to the reference; we report whether it is, but only require the tolerance, which leaves room for
e.g. multiplying by 1/N instead of dividing by N (1 ulp at N=3).
"""
import torch
import torch.nn as nn

from minizero import memory
from minizero_course.grader import Check, CheckFailed, Lab
from minizero_course.grader.hints import update_size_cause
from minizero.data import shard
from minizero.dp.ddp import DDP as ReferenceDDP
from minizero.models import build_model
from minizero_course.experiments.references import (buffer_bytes, flat_params, global_batches, make_optimizer,
                                                    train_torch_ddp)

LAB = Lab(2, "bucketed_ddp", "Bucketed DDP, overlapped with backward", "minizero/dp/ddp.py")

# The small tied GPT of tests/test_ddp.py, and the edge model (tied, frozen, unused parameters,
# a buffer). Bucket sizes split each into several buckets; the edge model's unused parameter
# sits in the last one, which therefore only fills at finish.
MODELS = {"tiny-gpt": dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True),
          "edge": {}}
BUCKET_NUMEL = {"tiny-gpt": 5000, "edge": 50}  # fp32 gradients per bucket
STEPS, BATCH, LR = 3, 12, 0.1
RTOL, ATOL = 1e-6, 2e-7  # see the module docstring


def psi(name):
    """Trainable elements, a tied weight once: what DDP must all-reduce each step."""
    return sum(p.numel() for p in build_model(name, seed=0, **MODELS[name]).parameters() if p.requires_grad)


def _worst(model, ref_flat):
    """(atol needed at rtol 1e-6, max |diff|, parameter name) for the worst parameter of model vs a flat vector."""
    rows, off = [], 0
    for name, p in model.named_parameters():
        ref = ref_flat[off:off + p.numel()].view_as(p)
        off += p.numel()
        d = (p.detach() - ref).abs()
        rows.append(((d - RTOL * ref.abs()).clamp_min(0).max().item(), d.max().item(), name))
    return max(rows)


class _Step:
    """Train one DDP wrapper step by step and note what a check needs to see of each step."""

    def __init__(self, ddp_cls, model, mode, comm, bucket_numel):
        from minizero_course.experiments.timed_comm import TimedComm
        self.model = model
        self.ready = {}  # id(param) -> how many gradients were ready before it
        # TimedComm with a logical clock: at each all-reduce launch, note how many gradients
        # were ready. Our hooks are registered after DDP's, so they run after its hook for
        # the same parameter: a bucket launched from parameter p's hook sees p not yet counted.
        self.comm = TimedComm(comm, lambda: len(self.ready))
        self.ddp = ddp_cls(self.model, self.comm, mode=mode, bucket_numel=bucket_numel)
        for p in self.ddp.params:
            p.register_post_accumulate_grad_hook(self._note)
        self.opt = make_optimizer("sgd", self.model.parameters(), LR)
        self.log = {"sent": [], "messages": [], "in_backward": [], "launch_clock": [], "full_clock": [],
                    "grad_bytes": [], "grad_bytes_backward": [], "unused_none": [], "frozen_none": [],
                    "unwaited": []}

    def _note(self, p):
        self.ready.setdefault(id(p), len(self.ready))

    def step(self, batch, rank, n):
        comm = self.comm._comm
        self.ready.clear()
        self.comm.records.clear()
        comm.stats.reset()
        self.ddp(*shard(batch, rank, n))[1].backward()
        calls = lambda: comm.stats.ops["all_reduce"].calls if "all_reduce" in comm.stats.ops else 0  # noqa: E731
        self.log["in_backward"].append(calls())
        # gradient memory at the end of backward, before finish: the high-water mark of p.grad
        self.log["grad_bytes_backward"].append(memory.measure(self.ddp).by_category["gradients"])
        self.ddp.finish_gradient_synchronization()
        self.log["unwaited"].append(len(self.comm.in_flight("all_reduce")))  # async all-reduces never waited for
        self.log["sent"].append(comm.stats.sent())
        self.log["messages"].append(calls())
        self.log["launch_clock"].append([r["launch"] for r in self.comm.records if r["op"] == "all_reduce"])
        # when each bucket was complete, on the same clock (the bucket layout is reference code)
        total = len(self.ready)
        self.log["full_clock"].append([max(self.ready.get(id(p), total) for p in b.params) for b in self.ddp.buckets])
        self.log["grad_bytes"].append(memory.measure(self.ddp).by_category["gradients"])
        if hasattr(self.model, "unused"):
            self.log["unused_none"].append(self.model.unused.grad is None)
            self.log["frozen_none"].append(self.model.frozen.weight.grad is None)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _update_ratio(mine, ref, before):
    """|the student's step| / |the reference's step|: N or 1/N names a wrong average (SGD)."""
    moved = [(flat_params(s.model) - b).norm().item() for s, b in zip((mine, ref), before)]
    return moved[0] / moved[1] if moved[1] else float("nan")


def worker(comm, impl):
    """Per model and mode: the student's DDP and the reference, step by step, then torch DDP."""
    from minizero.launch import load_target
    student_cls = load_target(impl + ":DDP")
    out = {}
    for name in MODELS:
        for mode in ("bucketed", "overlap"):
            mine, ref = (_Step(cls, build_model(name, seed=0, **MODELS[name]), mode, comm, BUCKET_NUMEL[name])
                         for cls in (student_cls, ReferenceDDP))
            first_bad, bitwise = None, True
            for k, batch in enumerate(global_batches(mine.model, STEPS, BATCH)):
                before = [flat_params(s.model) for s in (mine, ref)]
                mine.step(batch, comm.rank, comm.size)  # the student's first: a stub fails before any reference work
                ref.step(batch, comm.rank, comm.size)
                need, diff, pname = _worst(mine.model, flat_params(ref.model))
                bitwise &= torch.equal(flat_params(mine.model), flat_params(ref.model))
                if first_bad is None and need > ATOL:
                    first_bad = {"step": k, "param": pname, "max_diff": diff,
                                 "update_ratio": _update_ratio(mine, ref, before)}
            out[f"{name}/{mode}"] = {"first_bad": first_bad, "bitwise": bitwise, "buckets": len(mine.ddp.buckets),
                                     "mine": mine.log, "ref": ref.log, "final": flat_params(mine.model).tolist()}
    for name in MODELS:
        theirs = torch.tensor(train_torch_ddp(comm, name, STEPS, BATCH, LR, model_kwargs=MODELS[name])["params"])
        probe = build_model(name, seed=0, **MODELS[name])
        for mode in ("bucketed", "overlap"):
            res = out[f"{name}/{mode}"]
            torch.nn.utils.vector_to_parameters(torch.tensor(res.pop("final")), probe.parameters())
            need, diff, pname = _worst(probe, theirs)
            res["vs_torch"] = {"atol_needed": need, "max_diff": diff, "param": pname}
    return out


class RankDependent(nn.Module):
    """A model whose ranks disagree: rank 1 computes the branches in the opposite order, so
    backward produces their gradients in the opposite order too (autograd runs the latest
    node first), and only rank 0 uses `only_rank0`. Branch k reads k fewer features, so every
    branch (one bucket each at bucket_numel=1) has its own size: launching buckets in the
    order they fill would pair different sizes, which MINIZERO_DEBUG reports."""

    def __init__(self, rank, width=8, inputs=4, outputs=3):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.rank = rank
        self.only_rank0 = nn.Linear(width, width)  # registered first: its bucket is launched last
        self.inp = nn.Linear(inputs, width)
        self.branches = nn.ModuleList(nn.Linear(width - k, width, bias=False) for k in range(3))
        self.head = nn.Linear(width, outputs)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        order = range(len(self.branches)) if self.rank % 2 == 0 else reversed(range(len(self.branches)))
        z = sum(self.branches[k](h[:, :h.shape[1] - k]) for k in order)
        if self.rank == 0:
            z = z + self.only_rank0(h)
        out = self.head(torch.tanh(z))
        return out, nn.functional.mse_loss(out, y)


def orders_worker(comm, impl):
    """The student's overlapped DDP and the reference on RankDependent (N=2), step by step."""
    from minizero.data import regression_batch
    from minizero.launch import load_target
    student_cls = load_target(impl + ":DDP")
    mine, ref = (_Step(cls, RankDependent(comm.rank), "overlap", comm, bucket_numel=1)
                 for cls in (student_cls, ReferenceDDP))
    first_bad = None
    for k in range(STEPS):
        batch = regression_batch(k, 8, 4, 3, seed=1)
        mine.step(batch, comm.rank, comm.size)
        ref.step(batch, comm.rank, comm.size)
        need, diff, pname = _worst(mine.model, flat_params(ref.model))
        if first_bad is None and need > ATOL:
            first_bad = {"step": k, "param": pname, "max_diff": diff}
    return {"first_bad": first_bad, "mine": mine.log, "ref": ref.log}


# ------------------------------------------------------------------ checks
_CACHE = {}


def _results(impl, n):
    """One launch per (impl, N), shared by the checks (a launch costs seconds); a failure is
    kept too, and re-raised to each check that needs this launch."""
    from minizero import launch
    if (impl, n) not in _CACHE:
        try:
            _CACHE[(impl, n)] = launch.run("minizero_course.grader.lab02:worker", nprocs=n, args={"impl": impl},
                                           timeout=180)
        except launch.LaunchError as e:
            _CACHE[(impl, n)] = e
    if isinstance(_CACHE[(impl, n)], Exception):
        raise _CACHE[(impl, n)]
    return _CACHE[(impl, n)]


def _runs(impl, names=tuple(MODELS)):
    """(N, model name, mode, rank, that rank's result, "where" for a message) over both launches."""
    for n in (2, 3):
        for name in names:
            for mode in ("bucketed", "overlap"):
                for rank, out in enumerate(_results(impl, n)):
                    yield n, name, mode, rank, out[f"{name}/{mode}"], f"N={n}, {name}, mode {mode!r}: rank {rank}"


def _equal(impl, names):
    for n, name, mode, rank, r, where in _runs(impl, names):
        unwaited = r["mine"]["unwaited"]
        if any(unwaited):
            step = next(k for k, u in enumerate(unwaited) if u)
            raise CheckFailed(f"{where}: finish_gradient_synchronization returned at step {step + 1} with "
                              f"{unwaited[step]} all-reduce(s) never waited for: until its wait() returns a bucket's "
                              "buffer may still hold this rank's own gradients, so dividing by N and reading it races "
                              "the reduction; wait for every work of every bucket before dividing")
        if r["first_bad"]:
            b = r["first_bad"]
            raise CheckFailed(f"{where} parameter `{b['param']}` differs from the reference DDP after step "
                              f"{b['step'] + 1} (max diff {b['max_diff']:.3g}, tolerance rtol {RTOL:g} + atol "
                              f"{ATOL:g})."
                              + update_size_cause(b["update_ratio"], n))
        t = r["vs_torch"]
        if t["atol_needed"] > ATOL:
            raise CheckFailed(f"{where} parameter `{t['param']}` differs from torch DistributedDataParallel after "
                              f"{STEPS} steps (max diff {t['max_diff']:.3g})")
    return [f"N={n} {name} {mode}: {'bitwise equal to' if r['bitwise'] else 'within tolerance of'} the reference "
            f"DDP, torch DDP max diff {r['vs_torch']['max_diff']:.1e}"
            for n, name, mode, rank, r, _ in _runs(impl, names) if rank == 0]


def check_equal(impl):
    return "\n".join(_equal(impl, ["tiny-gpt"]))


def check_edge(impl):
    lines = _equal(impl, ["edge"])
    for n, name, mode, rank, r, where in _runs(impl, ["edge"]):
        if not all(r["mine"]["unused_none"]):
            raise CheckFailed(f"{where}: the parameter no rank used has a gradient after finish; it must stay None, "
                              "as in one process (Adam would otherwise update it)")
        if not all(r["mine"]["frozen_none"]):
            raise CheckFailed(f"{where}: the frozen parameter got a gradient")
    return "\n".join(lines + ["unused parameter: grad None on every rank; frozen: grad None"])


def check_bytes(impl):
    lines = set()
    for n, name, mode, rank, r, where in _runs(impl):
        buffers = (n - 1) / n * buffer_bytes(build_model(name, seed=0, **MODELS[name]))  # rank 0's, each forward
        want = 2 * (n - 1) / n * psi(name) * 4 + buffers
        for k, (sent, msgs) in enumerate(zip(r["mine"]["sent"], r["mine"]["messages"])):
            if abs(sent - want) > 1e-9 * want:
                raise CheckFailed(f"{where} sent {sent:.0f} bytes in step {k + 1}; one all-reduce of every gradient "
                                  f"sends 2(N-1)/N*Psi*4 = {want - buffers:.0f}, plus {buffers:.0f} for the buffers "
                                  "broadcast before the forward")
            if msgs != r["buckets"]:
                raise CheckFailed(f"{where} made {msgs} all-reduce calls in step {k + 1}; with {r['buckets']} buckets "
                                  "that should be one per bucket")
        lines.add(f"N={n} {name}: {want:.0f} B per rank per step = 2(N-1)/N*Psi*4, one message per bucket")
    return "\n".join(sorted(lines))


def check_overlap_and_memory(impl):
    for n, name, mode, rank, r, where in _runs(impl):
        mine, ref = r["mine"], r["ref"]
        if mine["in_backward"] != ref["in_backward"]:
            raise CheckFailed(f"{where} launched {mine['in_backward']} all-reduces during backward in steps "
                              f"1..{STEPS}, the reference {ref['in_backward']}" + (
                                  " (bucketed waits for finish)" if mode == "bucketed" else
                                  " (launch every bucket as soon as it and those before it are full)"))
        for k, (got, want, full) in enumerate(zip(mine["launch_clock"], ref["launch_clock"], ref["full_clock"])):
            if len(got) != len(want):
                raise CheckFailed(f"{where}, step {k + 1}: {len(got)} all-reduce calls, the reference makes "
                                  f"{len(want)} (one per bucket)")
            if got != want:
                b = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
                raise CheckFailed(f"{where}, step {k + 1}: bucket {b} was launched after {got[b]} gradients were "
                                  f"ready; it was full after {full[b]} and the reference launches it after {want[b]}")
        for k, (g, want) in enumerate(zip(mine["grad_bytes_backward"], ref["grad_bytes_backward"])):
            if g > want:
                raise CheckFailed(f"{where}, step {k + 1}: right after backward (before finish) the ledger counts "
                                  f"{g} bytes of gradients, the reference {want}: a gradient copied into its bucket "
                                  "must become the bucket's view (p.grad = slot), so autograd's own tensor is "
                                  "freed during backward, not kept until finish")
        for k, g in enumerate(mine["grad_bytes"]):
            if g != 4 * psi(name):
                raise CheckFailed(f"{where}, step {k + 1}: the ledger counts {g} bytes of gradients after finish, "
                                  f"expected 4*Psi = {4 * psi(name)} (each p.grad must be a view into its bucket, "
                                  "not a copy)")
    lines = []
    for n in (2, 3):
        r0 = _results(impl, n)[0]["tiny-gpt/overlap"]
        lines.append(f"N={n} tiny-gpt: {r0['mine']['in_backward'][0]} of {r0['buckets']} buckets launched during "
                     f"backward, each as soon as it was full; gradients {r0['mine']['grad_bytes'][0]} B = 4*Psi")
    return "\n".join(lines)


def check_rank_orders(impl):
    from minizero import launch
    # MINIZERO_DEBUG: every collective first compares its shape across ranks, so ranks that
    # launch different buckets fail at once with a clear message instead of adding wrong buckets
    res = launch.run("minizero_course.grader.lab02:orders_worker", nprocs=2, args={"impl": impl}, timeout=90,
                     env={"MINIZERO_DEBUG": "1"})
    where = "N=2, rank 1 produces the branches' gradients in the opposite order, only rank 0 uses `only_rank0`"
    for rank, r in enumerate(res):
        if r["first_bad"]:
            b = r["first_bad"]
            raise CheckFailed(f"{where}: rank {rank} parameter `{b['param']}` differs from the reference DDP after "
                              f"step {b['step'] + 1} (max diff {b['max_diff']:.3g}). A parameter another rank used "
                              "gets the average even where this rank had no gradient; buckets go out in bucket "
                              "order whatever order the gradients come in")
        if r["mine"]["in_backward"] != r["ref"]["in_backward"]:
            raise CheckFailed(f"{where}: rank {rank} launched {r['mine']['in_backward']} all-reduces during backward, "
                              f"the reference {r['ref']['in_backward']}: launch every full bucket in bucket order, "
                              "each as soon as it and all those before it are full")
    r0, r1 = res[0]["ref"], res[1]["ref"]
    return (f"{where}: equal to the reference DDP for {STEPS} steps; all-reduces launched during backward: "
            f"rank 0 {r0['in_backward']}, rank 1 {r1['in_backward']}, as the reference")


CHECKS = [
    Check("overlap and bucketed DDP equal the reference DDP and torch DDP (TinyGPT, N=2,3)", 4, check_equal),
    Check("tied, frozen and unused parameters (edge model)", 2, check_edge),
    Check("bytes per step = 2(N-1)/N*Psi*4, one all-reduce per bucket", 2, check_bytes),
    Check("overlap launches each bucket during backward when full; gradients are bucket views (4*Psi bytes)", 2,
          check_overlap_and_memory),
    Check("ranks with different gradient orders and different unused parameters (N=2)", 2, check_rank_orders),
]


def demo(comm, impl):
    """`mpirun -n 4 python labs/lab02_bucketed_ddp.py`: your overlapped DDP next to the reference
    on TinyGPT: loss per step, memory per rank (ledger), bytes sent per step and when buckets went out."""
    name, numel, steps = "tiny-gpt", 12_500, 8
    runs = {}
    for label, cls in (("yours", impl.DDP), ("reference", ReferenceDDP)):
        model = build_model(name, seed=0)
        ddp = cls(model, comm, mode="overlap", bucket_numel=numel)
        opt = make_optimizer("sgd", model.parameters(), LR)
        losses, sent, early = [], [], []
        for batch in global_batches(model, steps, 4 * comm.size):
            comm.stats.reset()
            loss = ddp(*shard(batch, comm.rank, comm.size))[1]
            loss.backward()
            early.append(comm.stats.ops["all_reduce"].calls if "all_reduce" in comm.stats.ops else 0)
            ddp.finish_gradient_synchronization()
            sent.append(comm.stats.sent())
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(sum(comm.allgather_object(loss.item())) / comm.size)  # mean of shard means
        ledger = memory.measure(ddp)
        runs[label] = dict(losses=losses, sent=sent, early=early, buckets=len(ddp.buckets),
                           ledger=comm.allgather_object(ledger.by_category), params=flat_params(model))
    diff = (runs["yours"]["params"] - runs["reference"]["params"]).abs().max().item()
    diffs = comm.allgather_object(diff)
    if comm.rank == 0:
        p = sum(x.numel() for x in build_model(name, seed=0).parameters())
        y, r = runs["yours"], runs["reference"]
        print(f"TinyGPT ({p} params), overlapped DDP on {comm.size} ranks, {y['buckets']} buckets of <= {numel} "
              "elements")
        print(f"{'step':>4} {'loss (yours)':>13} {'loss (ref)':>11} {'sent B':>9} "
              f"{'buckets out during backward':>28}")
        for k in range(steps):
            print(f"{k:>4} {y['losses'][k]:>13.5f} {r['losses'][k]:>11.5f} {y['sent'][k]:>9.0f} "
                  f"{y['early'][k]:>18} of {y['buckets']}")
        print(f"bytes per step, 2(N-1)/N*Psi*4 = {2 * (comm.size - 1) / comm.size * p * 4:.0f}")
        print(f"max |your params - reference| per rank: {['%.1e' % d for d in diffs]}")
        for rank, led in enumerate(y["ledger"]):
            print(f"rank {rank} memory (bytes): " + ", ".join(f"{k} {v}" for k, v in led.items() if v)
                  + f"   (4*Psi = {4 * p})")
