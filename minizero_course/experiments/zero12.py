"""Lessons 04 and 05's measurements, and the harness labs 04 and 05 are graded with.

  * `side_by_side` trains DDP and a ZeRO stage in lockstep on the same data and reports
    both losses, the largest parameter difference (which parameter, which step), the
    ledger bytes per category and the bytes sent per step;
  * `sweep` runs it for N = 1, 2, 3, 4 on sub-groups of ONE 4-rank job (comm.split): one
    launch instead of four. A sub-group of n ranks is a real n-rank MPI communicator;
  * `lesson_zero1` / `lesson_zero2`: everything lesson 04 / 05 plots, in one 4-rank job.
"""
import contextlib

import torch

from minizero import memory
from minizero.data import shard
from minizero.dp.ddp import DDP
from minizero_course.experiments import loops
from minizero_course.experiments.references import flat_params, global_batches, make_optimizer
from minizero_course.experiments.timed_comm import TimedComm
from minizero.models import build_model
from minizero.zero.shard_grad_op import ShardGradOp
from minizero.zero.sharded_grad import is_placeholder
from minizero.zero.sharded_optimizer import ShardedOptimizer

GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
LR = {"sgd": 0.1, "adam": 1e-2}
SMALL_BUCKET_BYTES = {"tiny-gpt": 20_000, "edge": 200}  # per bucket, whatever the dtype


def build_zero(stage, cls, model, comm, opt, lr, bucket_numel=6_250_000):
    """-> (forward, step, zero_grad, objects for memory.measure, the FlatLayout, the wrapper)."""
    optimizer_cls, kw = ((torch.optim.SGD, {"lr": lr, "momentum": 0.9}) if opt == "sgd"
                         else (torch.optim.Adam, {"lr": lr}))
    if stage == 1:
        z = cls(model.parameters(), optimizer_cls, comm, **kw)
        return model, z.step, z.zero_grad, (model, z), z.layout, z
    z = cls(model, optimizer_cls, comm, bucket_numel=bucket_numel, **kw)
    return z, z.step, z.zero_grad, (z,), z.layout, z


def build_ddp(model, comm, opt, lr, mixed):
    """DDP plus its optimizer. With bf16 parameters, DDP needs fp32 master weights too (the
    paper's stage-0 baseline, 2+2+12 bytes): a ShardedOptimizer over a ONE-rank group is
    exactly that, an unsharded master-weight optimizer (ZeRO-1 at N=1)."""
    ddp = DDP(model, comm)
    if mixed:
        solo = comm.split(comm.rank, name=f"solo{comm.rank}")  # every rank calls split: collective
        cls = torch.optim.SGD if opt == "sgd" else torch.optim.Adam
        kw = {"lr": lr, "momentum": 0.9} if opt == "sgd" else {"lr": lr}
        optim = ShardedOptimizer(model.parameters(), cls, solo, gradients_reduced=True, **kw)
    else:
        optim = make_optimizer(opt, model.parameters(), lr)
    return ddp, optim


def side_by_side(comm, stage=1, cls=None, model="tiny-gpt", model_kwargs=None, opt="sgd", lr=None,
                 steps=5, batch=12, bucket_numel=None, dtype="float32", seed=0, micro=1):
    """Train DDP and ZeRO-`stage` (class `cls`, default: the reference) in lockstep; measure.
    ZeRO-2's default buckets cut each model into 5 to 7 (so they straddle shard boundaries).
    micro > 1: each step accumulates that many micro-batches (loss / micro each) before the
    step; DDP runs all but the last under no_sync(). ZeRO talks through a TimedComm whose clock
    counts the gradients ready so far: `handles` says whether its collectives were in flight
    while backward went on (overlap seen through the handles, not through timing)."""
    if cls is None:
        cls = ShardedOptimizer if stage == 1 else ShardGradOp
    model_kwargs = GPT if model_kwargs is None and model == "tiny-gpt" else (model_kwargs or {})
    lr = lr or LR[opt]
    dt = getattr(torch, dtype)
    bucket_numel = bucket_numel or SMALL_BUCKET_BYTES.get(model, 25_000_000) // dt.itemsize
    ref, mine = (build_model(model, seed=seed, **model_kwargs).to(dt) for _ in range(2))
    ddp, ddp_opt = build_ddp(ref, comm, opt, lr, dt != torch.float32)
    ready = []  # one entry per gradient that backward produced (the logical clock)
    zcomm = TimedComm(comm, lambda: len(ready))
    fwd, step, zero_grad, measured, layout, wrapper = build_zero(stage, cls, mine, zcomm, opt, lr, bucket_numel)
    in_flight_at_grad = []  # per gradient: ZeRO's reduces still in flight when it arrived

    def note(p):  # registered after the wrapper's hooks, so it runs after them
        in_flight_at_grad.append(len(zcomm.in_flight("reduce")))
        ready.append(id(p))
    for p in mine.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(note)
    names = [n for n, _ in mine.named_parameters()]
    out = {"losses": [], "ddp_losses": [], "sent": [], "ddp_sent": [], "diffs": [], "worst": None,
           "layout": {"numel": layout.numel, "padded_numel": layout.padded_numel, "shard_numel": layout.shard_numel}}
    for s, b in enumerate(global_batches(mine, steps, batch, seed=seed)):
        before = [flat_params(m) for m in (mine, ref)]  # how far each step moves the weights
        x, y = shard(b, comm.rank, comm.size)
        parts = list(zip(x.chunk(micro), y.chunk(micro)))  # the micro-batches of this step
        comm.stats.reset()  # ZeRO first: a lab stub fails before DDP does any work
        memory.transient.reset()
        zcomm.records.clear()
        ready.clear()
        in_flight_at_grad.clear()
        loss = 0.0
        for xm, ym in parts:
            part_loss = fwd(xm, ym)[1] / micro
            part_loss.backward()
            loss += part_loss.item()
        out["backward_peak"] = memory.transient.peak
        # a placeholder .grad (one element of storage, for torch's clip line) holds no gradient
        out["grads_left"] = sum(p.grad is not None and not is_placeholder(p.grad) for p in mine.parameters())
        step()
        reduces = [r for r in zcomm.records if r["op"] == "reduce"]
        out["handles"] = {"reduces": len(reduces), "blocking_reduces": sum(not r["async"] for r in reduces),
                          "in_flight_at_a_gradient": sum(n > 0 for n in in_flight_at_grad),
                          "never_waited": [r["op"] for r in zcomm.in_flight()]}
        out["sent"].append(comm.stats.sent())
        out["sent_by_op"] = {op: v["sent_bytes"] for op, v in comm.stats.as_dict().items()}
        out["ledger"] = memory.measure(*measured).by_category  # after step: state exists
        zero_grad()
        comm.stats.reset()
        ref_loss = 0.0
        for i, (xm, ym) in enumerate(parts):
            with ddp.no_sync() if i < micro - 1 else contextlib.nullcontext():
                part_loss = ddp(xm, ym)[1] / micro
                part_loss.backward()
            ref_loss += part_loss.item()
        ddp.finish_gradient_synchronization()
        ddp_opt.step()
        out["ddp_sent"].append(comm.stats.sent())
        out["ddp_ledger"] = memory.measure(ddp, ddp_opt).by_category
        ddp_opt.zero_grad(set_to_none=True)
        out["losses"].append(loss)
        out["ddp_losses"].append(ref_loss)
        worst = None  # the parameter furthest from DDP after this step
        for name, p, q in zip(names, mine.parameters(), ref.parameters()):
            d = (p.detach().float() - q.detach().float()).abs()
            excess = (d - 1e-6 * q.detach().float().abs()).max().item()  # atol needed at rtol 1e-6
            if worst is None or not excess <= worst["atol_needed"]:  # NaN wins
                worst = {"step": s, "param": name, "max_diff": d.max().item(), "atol_needed": excess}
        moved = [(flat_params(m) - b).norm().item() for m, b in zip((mine, ref), before)]
        worst["update_ratio"] = moved[0] / moved[1] if moved[1] else float("nan")  # |ZeRO's step| / |DDP's|
        out["diffs"].append(worst)
        if out["worst"] is None or not worst["atol_needed"] <= out["worst"]["atol_needed"]:
            out["worst"] = worst
    if stage == 2:
        out.update(bucket_numels=[b.hi - b.lo for b in wrapper.buckets], launched_in_hooks=wrapper.launched_in_hooks)
    # global mean losses (mean of the ranks' shard means): after the loop, so not in `sent`
    both = torch.tensor([out["losses"], out["ddp_losses"]], dtype=torch.float64)
    comm.all_reduce(both, op="avg")
    out["losses"], out["ddp_losses"] = both.tolist()
    return out


def sweep(comm, sizes=(1, 2, 3, 4), **kwargs):
    """side_by_side for each N in `sizes` on ranks 0..N-1 of this job: {"N": result per rank}
    on ranks < N. Ranks >= N wait at the next split (a collective of the whole job)."""
    # The first torch optimizer a process builds imports torch._dynamo (seconds). Pay that on
    # every rank at once, not one rank after another as the groups grow.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    out = {}
    for n in sizes:
        if n > comm.size:
            raise ValueError(f"sweep: N={n} needs a job of at least {n} ranks, this one has {comm.size}")
        group = comm.split(0 if comm.rank < n else 1, name=f"n{n}")
        if comm.rank < n:
            out[str(n)] = side_by_side(group, **kwargs)
    return out


def lesson_zero1(comm, stage=1, memory_steps=2, loss_steps=20):
    """Lesson 04/05's measurements in ONE 4-rank job. Memory and bytes for N = 1..4 with the
    paper's setting (bf16 parameters and gradients, fp32 master + Adam: 2 + 2 + 12 bytes), on
    the default TinyGPT; then fp32 loss curves of DDP and ZeRO at N=4, and the DDP and ZeRO
    training loops a student writes (experiments/loops.py), at N=4."""
    tiny = dict(model="tiny-gpt", model_kwargs={}, opt="adam")
    return {"sweep": sweep(comm, stage=stage, dtype="bfloat16", steps=memory_steps, **tiny),
            "curves": side_by_side(comm, stage=stage, steps=loss_steps, batch=16, lr=3e-3, **tiny),
            "loops": loops.all_strategies(comm, ("ddp", f"zero{stage}"))}


def bucket_sweep(comm, numels=(1250, 5000, 12_500, 25_000, 50_000, 250_000)):
    """Peak bucket memory during backward for several bucket sizes (fp32 default TinyGPT),
    with overlap, and once without (the same for every size: all buckets stay alive)."""

    rows = []
    for numel in numels:
        for overlap in (True, False) if numel == numels[0] else (True,):
            model = build_model("tiny-gpt", seed=0)
            z2 = ShardGradOp(model, torch.optim.Adam, comm, bucket_numel=numel, overlap=overlap, lr=1e-3)
            x, y = shard(global_batches(model, 1, 16)[0], comm.rank, comm.size)
            memory.transient.reset()
            z2(x, y)[1].backward()
            rows.append({"bucket_numel": numel, "overlap": overlap, "peak": memory.transient.peak,
                         "buckets": [(b.hi - b.lo) * 4 for b in z2.buckets], "launched_in_hooks": z2.launched_in_hooks,
                         "parts": [[b.lo, b.hi, [owner for owner, _, _ in b.parts]] for b in z2.buckets],
                         "psi_bytes": z2.layout.padded_numel * 4})
    return rows


def accumulation(comm, ks=(1, 2, 4)):
    """Bytes sent per optimizer step and gradient bytes held, for k micro-batches: plain
    accumulation (every backward reduces into the shard) vs no_sync (full gradients kept,
    one reduction)."""

    rows = []
    for k in ks:
        for mode in ("plain", "no_sync"):
            model = build_model("tiny-gpt", seed=0)
            z2 = ShardGradOp(model, torch.optim.Adam, comm, lr=1e-3)
            comm.stats.reset()
            grad_peak = 0
            for i, mb in enumerate(global_batches(model, k, 16)):
                x, y = shard(mb, comm.rank, comm.size)
                if mode == "no_sync" and i < k - 1:
                    with z2.no_sync():
                        (z2(x, y)[1] / k).backward()
                else:
                    (z2(x, y)[1] / k).backward()
                grad_peak = max(grad_peak, memory.measure(z2).by_category["gradients"])
            z2.step()
            rows.append({"k": k, "mode": mode, "sent": comm.stats.sent(), "grad_peak": grad_peak,
                         "psi_bytes": z2.layout.padded_numel * 4})
    return rows


def lesson_zero2(comm):
    """Lesson 05's measurements in ONE 4-rank job: lesson_zero1 for ZeRO-2 (the
    ZeRO-1 sweep only for the memory comparison), then buckets and accumulation at N=4."""
    out = lesson_zero1(comm, stage=2)
    out["sweep_z1"] = sweep(comm, stage=1, model="tiny-gpt", model_kwargs={}, opt="adam",
                                  dtype="bfloat16", steps=1)
    out["buckets"] = bucket_sweep(comm)
    out["accumulation"] = accumulation(comm)
    return out


def describe_saving(formula: float, measured: float) -> str:
    """The ZeRO-1 saving at N = 4, formula against the TinyGPT run (lesson 04, section 7)."""
    if f"{formula:.2f}" == f"{measured:.2f}":
        return (f"(measured on TinyGPT: {measured:.2f}×, the same to two decimals: the padding and the step counters "
                "the formula leaves out are too few bytes to show)")
    return (f"(measured on TinyGPT: {measured:.2f}×, {'below' if measured < formula else 'above'} the formula by "
            f"{abs(measured - formula):.2f}: the padding and the step counters the formula leaves out)")
