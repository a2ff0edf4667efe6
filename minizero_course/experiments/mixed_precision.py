"""Lesson 03's measurements: TinyGPT trained in fp32, fp16 and bf16 with minizero.precision.

`train` is the reference loop the lesson and lab 03's checks launch; the workers below it show
why each of Micikevicius et al.'s three tricks is needed (underflow without loss scaling, lost
updates without fp32 masters)."""
from __future__ import annotations

import torch

from minizero import memory, precision
from minizero import data as data_mod
from minizero.data import SyntheticTokens
from minizero.models import TinyGPT
from minizero.precision import DTYPES, LossScaler, MixedPrecisionOptimizer, clip_grad_norm_, fp32_loss

def train(comm=None, dtype="fp16", steps=20, lr=3e-3, batch_size=8, seed=0, fp16=None, clip_grad=0.0, inject=(),
          scaler_cls=LossScaler, optimizer_cls=MixedPrecisionOptimizer):
    """The reference loop (a launch target): TinyGPT, Adam, `steps` steps in fp32, fp16 or bf16.

    fp16: LossScaler keywords (DeepSpeed's "fp16" keys). inject: [rank, step] pairs at which that
    rank's first gradient element is set to inf after backward (a forced overflow). With several
    ranks it is data parallel: each rank takes its shard of the batch and the 16-bit gradients are
    averaged. Returns per-step losses (this rank's), scales, skips, the ledger before the last step."""
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    device = comm.device if comm is not None else torch.device("cpu")  # a GPU: the fp16 matmuls of tensor cores
    model = TinyGPT(seed=seed).to(device, DTYPES[dtype])
    if dtype == "fp32":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        scaler = scaler_cls(**(fp16 or {})) if dtype == "fp16" else None
        opt = optimizer_cls(model.parameters(), torch.optim.Adam, scaler, clip_grad, comm, lr=lr)
    data, inject = data_mod.SyntheticTokens(seed=seed), {tuple(i) for i in inject}
    memory.transient.reset()
    out = {"loss": [], "scale": [], "skipped": [], "num_params": model.num_params()}
    for step in range(steps):
        x, y = (t.to(device) for t in data_mod.shard(data.batch(step, batch_size), rank, size))
        loss = fp32_loss(model, x, y)
        scale = opt.loss_scaler.loss_scale if getattr(opt, "loss_scaler", None) is not None else 1.0
        opt.backward(loss) if dtype != "fp32" else loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if size > 1:  # plain data parallelism, one flat bucket: average the (scaled) 16-bit gradients
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, op="avg")
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))
        if (rank, step) in inject:
            grads[0].view(-1)[0] = float("inf")
        if step == steps - 1:
            out["ledger"] = memory.measure(model, opt).by_category
        if dtype == "fp32" and clip_grad > 0:
            clip_grad_norm_(grads, clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"].append(loss.item())
        out["scale"].append(scale)
        out["skipped"].append(bool(getattr(opt, "overflow", False)))
    out["transient_peak"] = memory.transient.peak
    out["sent"] = comm.stats.sent() if comm is not None else 0.0
    return out


def loss_tolerance(dtype, loss32):
    """How far a 16-bit run's loss may be from fp32's at the same step: one unit roundoff u of the
    16-bit format, relative (u = eps/2: 4.9e-4 fp16, 3.9e-3 bf16). Measured with `train` on TinyGPT,
    seeds 0-3 (torch 2.13, CPU): over the 20 steps lab 03's check runs, at most 0.27 u (fp16) and
    0.37 u (bf16), a margin of 2.7x or more; over lesson 03's 30 steps fp16 reaches 0.55 u (1.8x).
    Runs with different rounding drift apart as steps accumulate, so the check stays at 20 steps."""
    return torch.finfo(precision.DTYPES[dtype]).eps / 2 * abs(loss32)


def compare_dtypes(comm, steps=30, seed=0):
    """train in fp32, fp16 and bf16, one after the other in this one process; then the short
    fp16 loop a student writes (experiments/loops.py), under "loop"."""
    from minizero_course.experiments import loops
    out = {dt: train(None, dt, steps=steps, seed=seed) for dt in ("fp32", "fp16", "bf16")}
    out["loop"] = loops.mixed_precision(comm)
    return out


def _activation_grads(model, x, y, scale):
    """d(loss)/d(activation) at every block output and every MLP/attention input projection output,
    as fp32, divided by `scale`: what the fp16 backward pass actually carried, unscaled."""
    grads, hooks = [], []

    def keep(module, inputs, output):
        output.register_hook(lambda g: grads.append(g.detach().float().reshape(-1) / scale))
    for name, module in model.named_modules():
        if name.endswith(("c_fc", "c_attn")) or name.startswith("h.") and name.count(".") == 1:
            hooks.append(module.register_forward_hook(keep))
    (precision.fp32_loss(model, x, y) * scale).backward()
    for h in hooks:
        h.remove()
    return torch.cat(grads)


def underflow_worker(comm, batch_size=32, scales=(1, 2**4, 2**8, 2**12, 2**16, 2**20, 2**24, 2**28), seed=0):
    """What fp16 does to TinyGPT's activation gradients, for each loss scale S: the fraction flushed
    to zero, the median relative error and the fraction that overflowed, against an fp32 backward
    through the same (fp16-rounded) weights; whether a weight gradient overflowed (the step would be
    skipped). Plus a histogram of log2|g| of the fp32 activation gradients."""
    x, y = SyntheticTokens(seed=seed).batch(0, batch_size)
    ref = _activation_grads(TinyGPT(seed=seed).half().float(), x, y, 1.0)
    nz = ref != 0
    rows = []
    for s in scales:
        model = TinyGPT(seed=seed).half()
        g = _activation_grads(model, x, y, float(s))
        fin = torch.isfinite(g)
        rel = ((g - ref).abs() / ref.abs())[nz & fin]
        rows.append({"scale": s, "zero": float((g[nz] == 0).float().mean()), "overflow": float((~fin).float().mean()),
                     "median_rel_err": float(rel.median()) if rel.numel() else float("nan"),
                     "weight_grad_overflow": not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())})
    log2 = ref[nz].abs().log2()
    edges = torch.arange(-40.0, 4.0, 1.0)
    hist = torch.histogram(log2.clamp(-39.99, 3.99), bins=edges)[0]
    return {"rows": rows, "edges": edges.tolist(), "hist": hist.tolist(), "n": ref.numel(),
            "structural_zero": float((~nz).float().mean()), "max_abs": float(ref.abs().max())}


def lost_updates_worker(comm, lrs=(1e-2, 1e-3, 1e-4, 1e-5), steps=3, seed=0):
    """Why master weights: each Adam step's update u = (new master - old master), and the fraction of
    nonzero u that would vanish if added to the 16-bit weight in 16-bit arithmetic (w16 + u == w16)."""
    data, out = SyntheticTokens(seed=seed), {}
    for dtype in ("fp16", "bf16"):
        for lr in lrs:
            model = TinyGPT(seed=seed).to(precision.DTYPES[dtype])
            scaler = precision.LossScaler() if dtype == "fp16" else None
            opt = precision.MixedPrecisionOptimizer(model.parameters(), torch.optim.Adam, scaler, lr=lr)
            lost = total = 0
            for step in range(steps):
                x, y = data.batch(step, 8)
                opt.backward(precision.fp32_loss(model, x, y))
                old = [m.clone() for m in opt.masters]
                w16 = [p.detach().clone() for p in opt.params]
                opt.step()
                opt.zero_grad()
                for o, m, w in zip(old, opt.masters, w16):
                    u = m - o
                    moved = u != 0
                    lost += int(((w + u.to(w.dtype)) == w)[moved].sum())
                    total += int(moved.sum())
            out[f"{dtype} {lr:g}"] = lost / max(total, 1)
    return out
