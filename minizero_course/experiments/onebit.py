"""1-bit Adam's measurements (lesson 14, lab 13's checks and tests/test_onebit.py).

    warmup_equals_adam  OneBitAdam's warm-up against torch Adam / AdamW on all-reduced gradients
    phase_bytes         bytes one rank sends per step in each phase (comm.stats) beside the formula
    feedback_average    the running average of compressed all-reduces of fixed inputs, with and
                        without error feedback, against the true average
    convergence         TinyGPT trained side by side: Adam, 1-bit Adam, no warm-up, no error
                        feedback, 1-bit gradients inside Adam (CompressedGradientAdam); Adam's v
    describe_*          lesson 14's conclusions from those figures; step_model, the alpha-beta step
    lesson_worker       lesson 14's one job: all of the above but the warm-up check
    main                python -m minizero_course.experiments.onebit: docs/onebit.md's table and plot
"""
from __future__ import annotations

import time

import torch

from minizero.compression import (OneBitAdam, bytes_allreduce, bytes_compressed,
                                  compressed_allreduce, padded_numel)
from minizero.data import shard
from minizero_course.experiments.references import global_batches
from minizero.models import build_model

GPT = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)
VARIANTS = {  # name -> (freeze_step as a fraction of the run (None: never compress), error feedback)
    "Adam": (None, True),
    "1-bit Adam": (0.2, True),
    "no error feedback": (0.2, False),
    "no warm-up": (0.0, True),
}


COMPRESSED_ADAM = "1-bit gradients in Adam"  # the paper's failure: compressed inside Adam


class CompressedGradientAdam:
    """What 1-bit Adam is built to avoid: every step the gradients are averaged by the 1-bit
    compressed all-reduce (error feedback on both sides) and torch Adam steps on that average, so
    v = b2 v + (1 - b2) g^2 is fed compressed gradients from step 1. Error feedback makes the sum of
    the compressed g over steps right, which is all a method linear in g (SGD, momentum) needs; v
    is not linear in g: the sum of the compressed g^2 is not the sum of the true g^2."""

    def __init__(self, params, comm, lr=1e-3):
        self.params, self.comm = list(params), comm
        self.adam = torch.optim.Adam(self.params, lr=lr, foreach=False)
        n = sum(p.numel() for p in self.params)
        self.numel, self.padded = n, padded_numel(n, comm.size)
        self.errors = (torch.zeros(self.padded), torch.zeros(self.padded // comm.size))
        self.freeze_step = 0

    @torch.no_grad()
    def step(self):
        flat = torch.zeros(self.padded)
        flat[:self.numel] = torch.cat([p.grad.reshape(-1) for p in self.params])
        out = compressed_allreduce(flat, self.comm, *self.errors)[:self.numel]
        for p, part in zip(self.params, out.split([p.numel() for p in self.params])):
            p.grad.copy_(part.view_as(p))
        self.adam.step()

    def zero_grad(self, set_to_none=True):
        self.adam.zero_grad(set_to_none=set_to_none)

    def bytes_per_step(self, compressed=None) -> float:
        return bytes_compressed(self.numel, self.comm.size)


def _v_hat(opt) -> torch.Tensor:
    """Adam's bias-corrected variance, flat: what the step divides by (squared)."""
    parts = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            parts.append(st["exp_avg_sq"].reshape(-1) / (1 - group["betas"][1] ** st["step"]))
    return torch.cat(parts)


def v_drift(v_from: torch.Tensor, v_to: torch.Tensor) -> dict:
    """How far Adam's per-coordinate step 1/sqrt(v) moved between two steps: the median and the
    90th percentile over coordinates of |sqrt(v_to / v_from) - 1| (coordinates with v_from > 0)."""
    keep = v_from > 0
    r = ((v_to[keep] / v_from[keep]).sqrt() - 1).abs()
    return {"median": r.median().item(), "p90": r.quantile(0.9).item()}


def _gpt(seed=0):
    return build_model("tiny-gpt", seed=seed, **GPT)


def _step(model, batch, comm):
    x, y = shard(batch, comm.rank, comm.size)
    loss = model(x, y)[1]
    loss.backward()
    return loss


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def warmup_equals_adam(comm, steps=4, lr=3e-3, weight_decay=0.0, micro=2):
    """Largest |difference| of any parameter after `steps` warm-up steps of OneBitAdam and of torch Adam
    (AdamW when weight_decay) stepping on gradients all-reduced by hand; 0.0 is bitwise equal."""
    torch.set_num_threads(1)
    mine, ref = _gpt(), _gpt()
    opt = OneBitAdam(mine.parameters(), comm, lr=lr, freeze_step=steps + 1, weight_decay=weight_decay)
    kind = torch.optim.AdamW if weight_decay else torch.optim.Adam
    ref_opt = kind(ref.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    for batch in global_batches(mine, steps, micro * comm.size):
        _step(mine, batch, comm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _step(ref, batch, comm)
        with torch.no_grad():
            params = [p for p in ref.parameters() if p.grad is not None]
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            comm.all_reduce(flat)
            flat.div_(comm.size)
            for p, part in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(part.view_as(p))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    return {"max_diff": _max_diff(mine, ref), "compressing": opt.compressing}


def phase_bytes(comm, freeze_step=2, steps=4, micro=2, per_tensor=True):
    """Per step: the bytes this rank sent (comm.stats, by op), the formula for that phase, and whether the
    parameters are still equal on every rank (compressed_allreduce must give every rank the same m)."""
    torch.set_num_threads(1)
    model = _gpt()
    opt = OneBitAdam(model.parameters(), comm, lr=3e-3, freeze_step=freeze_step, per_tensor=per_tensor)
    rows = []
    for batch in global_batches(model, steps, micro * comm.size):
        compressed = opt.compressing
        formula = opt.bytes_per_step()
        _step(model, batch, comm)
        comm.stats.reset()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sent = {op: s["sent_bytes"] for op, s in comm.stats.as_dict().items()}
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = comm.allgather_object(flat)
        rows.append({"compressed": compressed, "sent": sent, "formula": formula,
                     "replicated": all(torch.equal(flat, other) for other in everyone)})
    return {"rows": rows, "tensors": [p.numel() for p in model.parameters()]}


def feedback_average(comm, numel=1000, calls=(1, 10, 100, 400), seed=0):
    """Each rank all-reduces the same fixed x_r again and again, compressed. Relative L2 distance of the
    running mean of the results from the true mean over ranks, after each count in `calls`, with error
    feedback and without; and the bytes one call sent against bytes_compressed."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed + comm.rank)
    n = padded_numel(numel, comm.size)
    x = torch.zeros(n)
    x[:numel] = torch.randn(numel, generator=gen) + 0.5 * comm.rank
    truth = x.clone()
    comm.all_reduce(truth)
    truth = truth[:numel] / comm.size
    out = {}
    for feedback in (True, False):
        worker = torch.zeros(n) if feedback else None
        server = torch.zeros(n // comm.size) if feedback else None
        total, errors = torch.zeros(numel), {}
        for k in range(1, max(calls) + 1):
            comm.stats.reset()
            total += compressed_allreduce(x, comm, worker, server)[:numel]
            if k in calls:
                errors[k] = ((total / k - truth).norm() / truth.norm()).item()
        out["feedback" if feedback else "none"] = errors
    out["sent"] = comm.stats.sent()
    out["formula"] = bytes_compressed(numel, comm.size)
    return out


def convergence(comm, steps=150, lr=3e-3, micro=4, variants=tuple(VARIANTS), seed=0,
                per_tensor=False, watch=(20, 50)):
    """Every variant trained side by side on the same batches (step k of each, then k+1): per
    variant the loss (mean over ranks) per step, freeze_step, the bytes each phase sends per step
    by formula, and the seconds (this rank's) spent in step(), in all and per step.
    per_tensor=False: the momentum compressed as one flat buffer, 2 collectives a step instead of
    2 per tensor (58 for this model: 8x slower on 2 busy cores). With "Adam" and "1-bit Adam"
    both run, res["Adam"]["v"] says how Adam's v moved (v_drift) from 1-bit Adam's freeze step
    to `watch` steps later and to the end, and over as many steps before the freeze, and holds
    the L1 norm of Adam's v-hat per step."""
    torch.set_num_threads(1)
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # the first Adam imports torch._dynamo: now
    runs = {}
    for name in variants:
        model = _gpt(seed)
        if name == COMPRESSED_ADAM:
            runs[name] = (model, CompressedGradientAdam(model.parameters(), comm, lr=lr))
            continue
        fraction, feedback = VARIANTS[name]
        freeze = steps + 1 if fraction is None else int(fraction * steps)
        runs[name] = (model, OneBitAdam(model.parameters(), comm, lr=lr, freeze_step=freeze,
                                        error_feedback=feedback, per_tensor=per_tensor))
    res = {name: {"loss": [], "freeze_step": opt.freeze_step,
                  "bytes_warmup": opt.bytes_per_step(False),
                  "bytes_compressed": opt.bytes_per_step(True), "step_s": 0.0, "step_times": []}
           for name, (_, opt) in runs.items()}
    track = "Adam" in runs and "1-bit Adam" in runs
    freeze = runs["1-bit Adam"][1].freeze_step if track else None
    wanted = {freeze, *(freeze + w for w in watch), steps} if track else set()
    wanted |= {max(1, freeze - w) for w in watch} if track else set()
    kept, l1 = {}, []
    for k, batch in enumerate(global_batches(runs[variants[0]][0], steps, micro * comm.size), 1):
        for name, (model, opt) in runs.items():
            loss = _step(model, batch, comm)
            t0 = time.perf_counter()
            opt.step()
            took = time.perf_counter() - t0
            res[name]["step_s"] += took
            res[name]["step_times"].append(took)
            opt.zero_grad(set_to_none=True)
            res[name]["loss"].append(loss.item())
        if track:
            v = _v_hat(runs["Adam"][1])
            l1.append(v.abs().sum().item())
            if k in wanted:
                kept[k] = v
    everyone = comm.allgather_object({n: r["loss"] for n, r in res.items()})
    for name, r in res.items():
        r["loss"] = [sum(v) / comm.size for v in zip(*(e[name] for e in everyone))]
    if track:
        after = {w: v_drift(kept[freeze], kept[freeze + w]) for w in watch if freeze + w <= steps}
        before = {w: v_drift(kept[max(1, freeze - w)], kept[freeze]) for w in watch}
        res["Adam"]["v"] = {"freeze_step": freeze, "l1": l1, "after": after, "before": before,
                    "to_end": v_drift(kept[freeze], kept[steps])}
    return res


def tail_loss(losses, last=10):
    """The mean loss over the last `last` steps: the run's end, less one batch's noise."""
    return sum(losses[-last:]) / len(losses[-last:])


def lesson_worker(comm, steps=150) -> dict:
    """Lesson 14, one 2-rank job: the bytes per phase (per tensor and flat), the error-feedback average and
    the four variants and 1-bit gradients inside Adam trained side by side."""
    t0 = time.perf_counter()
    out = {"bytes": {kind: phase_bytes(comm, per_tensor=kind == "per_tensor") for kind in ("per_tensor", "flat")},
           "feedback": feedback_average(comm, numel=1001)}
    out["convergence"] = convergence(comm, steps=steps,
                                     variants=tuple(VARIANTS) + (COMPRESSED_ADAM,))
    out["seconds"] = time.perf_counter() - t0
    return out


def report(runs: dict, ranks: int) -> list[str]:
    """The docs' table: per variant its freeze step, loss at the end, bytes per step in each phase and
    the whole run's bytes against Adam's (end_to_end_reduction)."""
    from minizero.compression import end_to_end_reduction
    adam = runs["Adam"]
    lines = [f"| variant ({ranks} ranks) | freeze_step | loss, last 10 steps | B/step warm-up | B/step 1-bit | "
             "run's bytes vs Adam |", "|---|---|---|---|---|---|"]
    for name, r in runs.items():
        steps = len(r["loss"])
        e2e = end_to_end_reduction(steps, r["freeze_step"], r["bytes_warmup"], r["bytes_compressed"])
        lines.append(f"| {name} | {min(r['freeze_step'], steps)} | {tail_loss(r['loss']):.3f} | "
                     f"{r['bytes_warmup']:,.0f} | {r['bytes_compressed']:,.0f} | {e2e:.2f}x fewer |")
    lines.append(f"\nAdam's step-to-step loss spread over its last 20 steps: "
                 f"{torch.tensor(adam['loss'][-20:]).std():.3f}")
    return lines


def plot(runs: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        ax.plot(range(len(r["loss"])), r["loss"], label=name, lw=1)
    freeze = runs["1-bit Adam"]["freeze_step"]
    ax.axvline(freeze, color="grey", ls=":", lw=1)
    ax.text(freeze + 1, 4.0, "freeze_step", color="grey")
    ax.set_ylim(0.8, 4.6)
    ax.set_xlabel("step")
    ax.set_ylabel("TinyGPT loss (mean over ranks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    import argparse
    from minizero import launch
    parser = argparse.ArgumentParser(prog="python -m minizero_course.experiments.onebit",
                                     description="1-bit Adam against Adam on TinyGPT: "
                                                 "the table and plot of docs/onebit.md")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--per-tensor", action="store_true", help="one compressed all-reduce per tensor (DeepSpeed's)")
    parser.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    args = parser.parse_args(argv)
    runs = launch.run("minizero_course.experiments.onebit:convergence", nprocs=args.ranks, timeout=1800,
                      args={"steps": args.steps, "per_tensor": args.per_tensor})[0]
    print("\n".join(report(runs, args.ranks)))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()


# Lesson 14's conclusions, written from the run's figures: one sentence per outcome.
def step_model(n: int, N: int, alpha: float, beta: float, compute_s: float, compress_s: float = 0.0,
               elem_bytes: int = 4):
    """The alpha-beta time of one data-parallel step (lesson 01's model), in seconds: (Adam,
    1-bit Adam's compressed phase). Both send 2(N-1) messages a step (a ring all-reduce; an
    all-to-all and an all-gather); the bytes are bytes_allreduce (of elem_bytes gradients) and
    bytes_compressed; compress_s is the time spent packing and unpacking signs, which the bytes
    must pay for."""
    adam = compute_s + 2 * (N - 1) * alpha + bytes_allreduce(n, N, elem_bytes) / beta
    onebit = compute_s + 2 * (N - 1) * alpha + bytes_compressed(n, N) / beta + compress_s
    return adam, onebit


def _window(losses, at, half=5):
    part = losses[max(0, at - half):at + half]
    return sum(part) / len(part)


def _diverged(losses, ceiling=2.0):
    """(step, value) of the first loss not finite or above ceiling x the first loss, or None."""
    for k, x in enumerate(losses, 1):
        if x != x or x in (float("inf"), float("-inf")) or x > ceiling * losses[0]:
            return k, x
    return None


def describe_gap(adam: list, onebit: list, freeze: int, spread: float, watch=(20, 50)) -> str:
    """1-bit Adam's loss against Adam's, watch steps after the freeze (means of 10 steps around
    each point) and over the last 10 steps, against Adam's step-to-step spread."""
    gaps = {w: _window(onebit, freeze + w) - _window(adam, freeze + w) for w in watch
            if freeze + w + 5 <= len(adam)}
    tail = tail_loss(onebit) - tail_loss(adam)
    s = "1-bit Adam's loss minus Adam's (means of 10 steps): " + ", ".join(
        f"{g:+.2f} at {w} steps after the freeze" for w, g in gaps.items())
    s += f", {tail:+.3f} over the last 10 steps (Adam's step-to-step spread: {spread:.3f}). "
    worst = max(gaps.values(), default=tail)
    if worst > spread and abs(tail) <= spread:
        s += ("It trails Adam after the freeze by more than the spread and catches up by the end "
              "of this run: judged on the last steps only, the two look the same, but for a while "
              "1-bit Adam is behind.")
    elif tail > spread:
        s += "It still trails Adam at the end of this run, by more than the spread."
    elif worst > spread:
        s += "It trails Adam after the freeze, and ends below Adam by more than the spread."
    else:
        s += "It stays within the spread of Adam throughout."
    return s


def _pct(d):
    return f"{100 * d['median']:.1f}% (90th percentile {100 * d['p90']:.0f}%)"


def describe_v(v: dict, watch=(20, 50)) -> str:
    """Adam's own v after 1-bit Adam's freeze step: v_drift (the per-coordinate step 1/sqrt(v))
    after and before the freeze. The keys of after/before may be str (the launch's JSON)."""
    F, w0 = v["freeze_step"], min(watch)
    after = {int(k): d for k, d in v["after"].items()}
    before = {int(k): d for k, d in v["before"].items()}
    moved = ", ".join(f"{_pct(d)} after {w} steps" for w, d in after.items())
    s = ("In the run without compression, Adam keeps updating v. Its per-coordinate step 1/√v̂ "
         f"moved, from step {F} (1-bit Adam's freeze), by a median {moved}, and "
         f"{_pct(v['to_end'])} by the end. Over the {w0} steps *before* step {F} it had moved "
         f"{_pct(before[w0])}. ")
    first = after[w0]["median"] if w0 in after else v["to_end"]["median"]
    if first <= 0.1:
        s += (f"So the frozen v is within {100 * first:.0f}% of Adam's own for most coordinates "
              f"{w0} steps on: stable enough to freeze here")
    else:
        s += (f"So v is **not** stable here: {w0} steps after the freeze, the frozen v already "
              "gives most coordinates a step more than 10% off Adam's")
    s += (", and it was moving more before the freeze than after." if before[w0]["median"] > first
          else ", though it moved no less after the freeze than before it.")
    return s


ABLATIONS = {
    "no error feedback": "drops both error buffers, so every compressed all-reduce rounds the "
                         "momentum with no memory of what the last one lost",
    "no warm-up": "is `freeze_step = 0`: v is frozen at zeros before any gradient, so the step "
                  "m/(√v + ε) is m/10⁻⁸. This is not the paper's failure; it is what freezing "
                  "nothing means",
    COMPRESSED_ADAM: "is the paper's failure case: the gradients compressed with error feedback "
                     "from step 1 and Adam run on them, v included. Error feedback keeps the "
                     "*sum* of the compressed g right, which is all a method linear in g needs; "
                     "v sums g², and the sum of the compressed g² (every coordinate ±scale, so "
                     "g² = scale² everywhere) is not the sum of the true g²",
}


def describe_ablations(conv: dict, spread: float) -> str:
    """The broken variants against Adam: diverged (the step and value), or how far they ended."""
    adam = tail_loss(conv["Adam"]["loss"])
    out = []
    for name, why in ABLATIONS.items():
        if name not in conv:
            continue
        losses = conv[name]["loss"]
        s = f"* **{name}** {why}. "
        gone = _diverged(losses)
        if gone:
            k, x = gone
            ended = tail_loss(losses)
            s += (f"It diverged: the loss reached {x:.3g} at step {k} (it started at "
                  f"{losses[0]:.2f})" + (" and ended as nan." if ended != ended else "."))
        else:
            gap = tail_loss(losses) - adam
            s += (f"It ended {gap:+.3f} from Adam over the last 10 steps: "
                  + ("it learned less (more than Adam's spread)." if gap > spread else
                     "within Adam's spread: here it did no harm." if abs(gap) <= spread else
                     "below Adam by more than the spread."))
        out.append(s)
    return "\n".join(out)


def describe_time(warm_s: float, compressed_s: float, n: int, N: int, models: dict) -> str:
    """This run's step() times per phase (1-bit Adam) and the alpha-beta model's steps for the
    settings in models: label -> (Adam s, 1-bit s)."""
    saved = bytes_allreduce(n, N) - bytes_compressed(n, N)
    s = (f"Here (TinyGPT, {n:,} parameters, {N} ranks on one machine) a warm-up step() took "
         f"{warm_s * 1e3:.2f} ms and a compressed one {compressed_s * 1e3:.2f} ms: ")
    if compressed_s < warm_s:
        s += ("compression paid even on shared memory, where moving bytes is cheap "
              f"({saved:,.0f} fewer bytes a step). ")
    else:
        extra = compressed_s - warm_s
        s += (f"compression cost {extra * 1e3:.2f} ms more than it saved by sending {saved:,.0f} "
              f"fewer bytes; in the model it pays on links slower than {saved / extra / 1e6:.2f} "
              "MB/s (saved bytes / extra seconds). ")
    for label, (adam, one) in models.items():
        s += (f"{label}: Adam {adam * 1e3:.0f} ms, 1-bit Adam {one * 1e3:.0f} ms a step, "
              f"{adam / one:.1f}×. ")
    return s
