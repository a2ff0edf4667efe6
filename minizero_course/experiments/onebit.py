"""1-bit Adam's measurements (lesson 14, lab 13's checks and tests/test_onebit.py).

    warmup_equals_adam  OneBitAdam's warm-up against torch Adam / AdamW on all-reduced gradients
    phase_bytes         bytes one rank sends per step in each phase (comm.stats) beside the formula
    feedback_average    the running average of compressed all-reduces of fixed inputs, with and
                        without error feedback, against the true average
    convergence         TinyGPT trained side by side: Adam, 1-bit Adam, no warm-up, no error feedback
    lesson_worker       lesson 14's one job: all of the above but the warm-up check
    main                python -m minizero_course.experiments.onebit: docs/onebit.md's table and plot
"""
from __future__ import annotations

import time

import torch

from minizero.compression import OneBitAdam, bytes_compressed, compressed_allreduce, padded_numel
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


def convergence(comm, steps=150, lr=3e-3, micro=4, variants=tuple(VARIANTS), seed=0, per_tensor=False):
    """Every variant trained side by side on the same batches (step k of each, then k+1): per variant the
    loss (mean over ranks) per step, freeze_step, the bytes each phase sends per step by formula, and
    the seconds (this rank's) spent in step(). per_tensor=False: the momentum compressed as one flat
    buffer, 2 collectives a step instead of 2 per tensor (58 for this model: 8x slower on 2 busy cores)."""
    torch.set_num_threads(1)
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # the first Adam imports torch._dynamo: now
    runs = {}
    for name in variants:
        fraction, feedback = VARIANTS[name]
        freeze = steps + 1 if fraction is None else int(fraction * steps)
        model = _gpt(seed)
        runs[name] = (model, OneBitAdam(model.parameters(), comm, lr=lr, freeze_step=freeze, error_feedback=feedback,
                                                  per_tensor=per_tensor))
    res = {name: {"loss": [], "freeze_step": opt.freeze_step, "bytes_warmup": opt.bytes_per_step(False),
                  "bytes_compressed": opt.bytes_per_step(True), "step_s": 0.0} for name, (_, opt) in runs.items()}
    for batch in global_batches(runs[variants[0]][0], steps, micro * comm.size):
        for name, (model, opt) in runs.items():
            loss = _step(model, batch, comm)
            t0 = time.perf_counter()
            opt.step()
            res[name]["step_s"] += time.perf_counter() - t0
            opt.zero_grad(set_to_none=True)
            res[name]["loss"].append(loss.item())
    everyone = comm.allgather_object({n: r["loss"] for n, r in res.items()})
    for name, r in res.items():
        r["loss"] = [sum(v) / comm.size for v in zip(*(e[name] for e in everyone))]
    return res


def tail_loss(losses, last=10):
    """The mean loss over the last `last` steps: the run's end, less one batch's noise."""
    return sum(losses[-last:]) / len(losses[-last:])


def lesson_worker(comm, steps=150) -> dict:
    """Lesson 14, one 2-rank job: the bytes per phase (per tensor and flat), the error-feedback average and
    the four variants trained side by side."""
    t0 = time.perf_counter()
    out = {"bytes": {kind: phase_bytes(comm, per_tensor=kind == "per_tensor") for kind in ("per_tensor", "flat")},
           "feedback": feedback_average(comm, numel=1001)}
    out["convergence"] = convergence(comm, steps=steps)
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
