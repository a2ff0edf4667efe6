"""Lab 03 checks: the fp16 loss scaler. Students write LossScaler.update (DeepSpeed's rule) and the
overflow vote in LossScaler.unscale_and_check; everything runs through minizero.launch, so a stub,
a crash or an endless loop in student code is a failed check, never a hung grader.

The lesson's own measurements (lessons/03_mixed_precision.ipynb) are in
minizero_course/experiments/mixed_precision.py."""
import torch

from minizero import precision
from minizero_course.grader import Check, CheckFailed, Lab
from minizero_course.experiments.mixed_precision import loss_tolerance, train

LAB = Lab(3, "loss_scaler", "Dynamic loss scaler for fp16 mixed precision", "minizero/precision.py")

# Scripted overflow patterns (1 = overflow) and scaler configs that exercise every branch of the rule:
# hysteresis spent and not refilled by halving, refilled by a doubling or (consecutive) by a good step,
# DeepSpeed's window+1 first doubling, the min_loss_scale floor, and the error at the floor.
PATTERNS = {
    "halve, then regrow": [1, 1, 1] + [0] * 10 + [1] + [0] * 5,
    "isolated overflows": [1, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0],
    "overflow streak": [1] * 12,
    "quiet": [0] * 14,
}
CONFIGS = [
    dict(initial_scale_power=6, loss_scale_window=3, hysteresis=2),
    dict(initial_scale_power=6, loss_scale_window=3, hysteresis=2, consecutive_hysteresis=True),
    dict(initial_scale_power=5, loss_scale_window=2, hysteresis=1, min_loss_scale=4),
    dict(initial_scale_power=3, loss_scale_window=4, hysteresis=3, min_loss_scale=0.5, raise_error_at_min_scale=False),
    dict(loss_scale=128.0),
]


def scale_trace(scaler_cls, config, pattern):
    """(scale, cur_hysteresis) after each update; ("raised", error class name) ends the trace."""
    s, out = scaler_cls(**config), []
    for overflow in pattern:
        try:
            s.update(bool(overflow))
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - the class name is what we compare
            out.append(("raised", type(e).__name__))
            break
        out.append((s.loss_scale, s.cur_hysteresis))
    return out


def trace_worker(comm, impl):
    from minizero.launch import load_target
    cls = load_target(impl + ":LossScaler")
    return {f"{name} | {cfg}": scale_trace(cls, cfg, pat) for cfg in CONFIGS for name, pat in PATTERNS.items()}


def check_update_rule(impl):
    from minizero import launch
    got = launch.run("minizero_course.grader.lab03:trace_worker", nprocs=1, args={"impl": impl}, timeout=60)[0]
    for cfg in CONFIGS:
        for name, pat in PATTERNS.items():
            want = [list(x) for x in scale_trace(precision.LossScaler, cfg, pat)]
            mine = got[f"{name} | {cfg}"]
            for i, (w, m) in enumerate(zip(want, mine)):
                if w != m:
                    raise CheckFailed(f"config {cfg}, pattern '{name}' {pat}: after update {i} "
                                      f"(overflow={bool(pat[i])}) you have (scale, cur_hysteresis) = {tuple(m)}, "
                                      f"DeepSpeed's rule gives {tuple(w)}")
            if len(want) != len(mine):
                raise CheckFailed(f"config {cfg}, pattern '{name}': your trace has {len(mine)} updates, expected "
                                  f"{len(want)} (the rule raises MinLossScaleError when the scale is at the floor)")
    return f"{len(CONFIGS) * len(PATTERNS)} scripted traces equal DeepSpeed's rule"


def skip_worker(comm, impl, steps=6, bad_step=3, bad_rank=1):
    """Replicas (same batch everywhere, no gradient averaging): only the overflow vote couples them.
    One rank's gradient gets an inf at bad_step: every rank must skip exactly that step."""
    from minizero.data import SyntheticTokens
    from minizero.launch import load_target
    from minizero.models import TinyGPT
    scaler_cls, opt_cls = load_target(impl + ":LossScaler"), load_target(impl + ":MixedPrecisionOptimizer")
    model = TinyGPT(seed=0).to(torch.float16)
    opt = opt_cls(model.parameters(), torch.optim.Adam, scaler_cls(initial_scale_power=10, hysteresis=1),
                  comm=comm, lr=3e-3)
    data, rows = SyntheticTokens(seed=0), []
    for step in range(steps):
        x, y = data.batch(step, 4)
        opt.backward(precision.fp32_loss(model, x, y))
        if step == bad_step and comm.rank == bad_rank:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        before = ([p.detach().clone() for p in model.parameters()], [m.clone() for m in opt.masters],
                  {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.optimizer.state.values())})
        scale_before = opt.loss_scaler.loss_scale
        opt.step()
        opt.zero_grad()
        state_now = list(opt.optimizer.state.values())
        rows.append({
            "skipped": bool(opt.overflow), "scale_before": scale_before, "scale_after": opt.loss_scaler.loss_scale,
            "params_same": all(torch.equal(a, p) for a, p in zip(before[0], model.parameters())),
            "masters_same": all(torch.equal(a, m) for a, m in zip(before[1], opt.masters)),
            "state_same": len(before[2]) == len(state_now) and all(
                torch.equal(v, state_now[i][k]) for i, s in before[2].items() for k, v in s.items()),
            "checksum": float(sum(p.double().sum() for p in model.parameters())),
        })
    return rows


def check_skip(impl):
    from minizero import launch
    bad = 3
    res = launch.run("minizero_course.grader.lab03:skip_worker", nprocs=2, args={"impl": impl, "bad_step": bad},
                     timeout=90)
    for rank, rows in enumerate(res):
        for step, r in enumerate(rows):
            if r["skipped"] != (step == bad):
                raise CheckFailed(f"rank {rank} step {step}: skipped={r['skipped']}, expected {step == bad} "
                                  f"(only rank 1 had an inf, at step {bad}; every rank must skip that step, no other)")
            if step == bad:
                for what in ("params", "masters", "state"):
                    if not r[f"{what}_same"]:
                        raise CheckFailed(f"rank {rank}: the skipped step {bad} changed the {what} "
                                          f"(a skipped step must leave model, masters and Adam state untouched)")
                if r["scale_after"] != r["scale_before"] / 2:
                    raise CheckFailed(f"rank {rank}: overflow with hysteresis=1 must halve the scale: "
                                      f"{r['scale_before']:g} -> {r['scale_after']:g}")
            elif r["params_same"]:
                raise CheckFailed(f"rank {rank} step {step}: a good step left the parameters unchanged")
    if [r["checksum"] for r in res[0]] != [r["checksum"] for r in res[1]]:
        raise CheckFailed("the ranks' parameters differ after training: they did not skip the same steps")
    return f"2 ranks, inf on rank 1 at step {bad}: both skipped exactly that step, state untouched, scale halved"


# Overflow votes: (name, {rank: gradients as (value, count) runs, fp16}, expected verdict on every rank).
# "big" is finite fp16 whose SUM is not: 64 x 60000 = 3.8e6 > 65504, so isfinite(g.sum()) is wrong.
VOTES = [
    ("finite values whose sum overflows fp16", {0: [[(60000.0, 64)]], 1: [[(60000.0, 64)]]}, False),
    ("an inf in rank 1's second tensor only", {0: [[(1.0, 8)], [(2.0, 8)]], 1: [[(1.0, 8)], [(2.0, 7), ("inf", 1)]]},
     True),
    ("a nan in rank 0 only", {0: [[(1.0, 3), ("nan", 1), (1.0, 4)]], 1: [[(1.0, 8)]]}, True),
    ("a -inf on rank 1 only", {0: [[(1.0, 8)]], 1: [[("-inf", 1), (1.0, 7)]]}, True),
    ("no gradients on rank 1, an inf on rank 0", {0: [[("inf", 1)]], 1: []}, True),
    ("no gradients on rank 1, finite on rank 0", {0: [[(3.0, 8)]], 1: []}, False),
]


def vote_worker(comm, impl, scale=1024.0):
    """unscale_and_check on scripted gradients: the verdict on this rank, and whether a finite
    verdict left the gradients divided by the scale."""
    from minizero.launch import load_target
    scaler = load_target(impl + ":LossScaler")(initial_scale_power=10)
    out = []
    for _, per_rank, _ in VOTES:
        grads = [torch.cat([torch.full((n,), float(v), dtype=torch.float16) for v, n in runs])
                 for runs in per_rank[comm.rank]]
        before = [g.clone() for g in grads]
        overflow = scaler.unscale_and_check(grads, comm)
        unscaled = all(torch.equal(g, b / scale) for g, b in zip(grads, before))
        out.append({"overflow": bool(overflow), "unscaled": unscaled})
    return out


def check_overflow_vote(impl):
    from minizero import launch
    res = launch.run("minizero_course.grader.lab03:vote_worker", nprocs=2, args={"impl": impl}, timeout=60)
    for i, (name, per_rank, want) in enumerate(VOTES):
        for rank, rows in enumerate(res):
            got = rows[i]["overflow"]
            if got is not want:
                why = ("every value is finite; it is their SUM that overflows fp16 (max 65504): test each element "
                       "with torch.isfinite(g).all(), not the sum" if not want and "sum" in name else
                       "inf and nan must both count (torch.isfinite), in every tensor, on any rank: all-reduce the "
                       "flag with op='max' over comm, also on a rank with no gradients")
                raise CheckFailed(f"gradients with {name}: rank {rank} decided overflow={got}, expected {want} on "
                                  f"every rank. {why}")
            if not want and not rows[i]["unscaled"]:
                raise CheckFailed(f"gradients with {name}: no overflow, yet rank {rank}'s gradients were not divided "
                                  "by the scale")
    return (f"{len(VOTES)} scripted votes on 2 ranks: inf/nan on one rank skips everywhere; finite sums that overflow "
            "do not")


def train_worker(comm, impl, steps=20):
    from minizero.launch import load_target
    mine = train(None, "fp16", steps=steps, scaler_cls=load_target(impl + ":LossScaler"),
                 optimizer_cls=load_target(impl + ":MixedPrecisionOptimizer"))
    ref = train(None, "fp32", steps=steps)
    return {"fp16": mine, "fp32": ref}


def check_training(impl):
    from minizero import launch
    r = launch.run("minizero_course.grader.lab03:train_worker", nprocs=1, args={"impl": impl}, timeout=120)[0]
    if any(r["fp16"]["skipped"]):
        raise CheckFailed(f"fp16 training skipped steps {[i for i, s in enumerate(r['fp16']['skipped']) if s]} "
                          "although no gradient overflows at the default scale 2^16: is your overflow test right?")
    worst = 0.0
    for step, (a, b) in enumerate(zip(r["fp32"]["loss"], r["fp16"]["loss"])):
        tol = loss_tolerance("fp16", a)
        worst = max(worst, abs(a - b) / tol)
        if abs(a - b) > tol:
            raise CheckFailed(f"step {step}: fp16 loss {b:.5f} vs fp32 {a:.5f}, off by {abs(a - b):.2e} > {tol:.2e}")
    return f"20 steps: fp16 loss within {worst:.2f} of the tolerance (u_fp16 * loss) of fp32's"


CHECKS = [
    Check("update(): scale trace equals DeepSpeed's rule on scripted overflows", 4, check_update_rule),
    Check("one rank's inf skips that step on every rank, state untouched", 4, check_skip),
    Check("fp16 training with your scaler tracks fp32", 2, check_training),
    Check("overflow vote: inf/nan on any rank, never a finite gradient whose sum overflows", 2, check_overflow_vote),
]


def demo(comm, impl):
    """`mpirun -n 4 python labs/lab03_loss_scaler.py`: data-parallel fp16 with overflows forced on the
    last rank, next to fp32; scale trace, memory per parameter and bytes per rank."""
    cfg = {"initial_scale_power": 12, "loss_scale_window": 4, "hysteresis": 2}
    inject = [[comm.size - 1, s] for s in (3, 4, 5, 12)]
    r16 = train(comm, "fp16", steps=16, fp16=cfg, inject=inject, scaler_cls=impl.LossScaler,
                optimizer_cls=impl.MixedPrecisionOptimizer)
    comm.stats.reset()
    r32 = train(comm, "fp32", steps=16)
    psi = r16["num_params"]
    per_param = comm.allgather_object({k: v / psi for k, v in r16["ledger"].items()})
    sent = comm.allgather_object(r16["sent"])
    if comm.rank == 0:
        print(f"fp16 {cfg}, inf forced on rank {comm.size - 1} at steps {[s for _, s in inject]}")
        print(f"{'step':>4} {'scale':>7} {'skipped':>8} {'loss fp16':>10} {'loss fp32':>10}")
        for i, (s, k, a, b) in enumerate(zip(r16["scale"], r16["skipped"], r16["loss"], r32["loss"])):
            print(f"{i:>4} {s:>7g} {str(k):>8} {a:>10.4f} {b:>10.4f}")
        for rank, d in enumerate(per_param):
            print(f"rank {rank} bytes/param: " + ", ".join(f"{k} {v:.3f}" for k, v in d.items() if v)
                  + f"  | sent {sent[rank]:,.0f} B")
        from minizero.comm import ring_bytes_sent
        per_step = ring_bytes_sent("all_reduce", 2 * psi, comm.size) + ring_bytes_sent("all_reduce", 4, comm.size)
        print(f"expected per rank: {len(r16['loss'])} steps x (fp16 gradients 2(N-1)/N*2*Psi + the 4-byte overflow "
              f"vote) = {len(r16['loss']) * per_step:,.0f} B")
