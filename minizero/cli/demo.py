"""`make demo` / `python -m minizero demo`: N ranks train a tiny GPT with DDP and ZeRO-1/2/3.

The same model, data and optimizer under each strategy, in one job. It prints one table
that holds the course's three claims side by side, each measured:
  * correctness: every rank ends with the same loss (and the same as one process would);
  * memory: the bytes each rank really holds (the ledger walks its tensors) next to the
    estimator's formula;
  * communication: the bytes each rank sent per step (counted in minizero.comm where they
    are sent) next to the ring formula 2(N-1)/N * Psi * bytes.
and writes a PNG: loss curves (one line per strategy: they coincide), memory per rank by
category, and bytes sent per step, each against its formula.

Each strategy is one entry in STRATEGIES: a function that wraps the model and returns
(wrapped model, optimizer, step_fn, ZeRO stage); step_fn runs forward, backward and the
optimizer step, and the memory is measured before the gradients are released. Everything is fp32
Adam, so the estimator is called with 4-byte parameters and gradients and K = 8 (Adam's m and v).
"""
from __future__ import annotations

import gc
import sys
import time

import torch

from minizero import memory
from minizero.data import SyntheticTokens, shard
from minizero.models import GPTConfig, TinyGPT

DEMO_CONFIG = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)


def _ddp(model, comm, lr):
    from minizero.dp.ddp import DDP
    wrapped = DDP(model, comm=comm, mode="overlap")
    opt = torch.optim.Adam(wrapped.parameters(), lr=lr)

    def step(x, y):
        _, loss = wrapped(x, y)
        loss.backward()
        wrapped.finish_gradient_synchronization()
        opt.step()
        return loss
    return wrapped, opt, step, 0


def _zero1(model, comm, lr):
    from minizero.zero.sharded_optimizer import ShardedOptimizer
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, comm=comm, lr=lr)

    def step(x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()  # reduce-scatter the gradients, step this rank's 1/N, all-gather parameters
        return loss
    return model, opt, step, 1


def _zero2(model, comm, lr):
    from minizero.zero.shard_grad_op import ShardGradOp
    wrapped = ShardGradOp(model, torch.optim.Adam, comm=comm, lr=lr)

    def step(x, y):
        _, loss = wrapped(x, y)
        loss.backward()  # gradients reduced to their owners during backward
        wrapped.step()
        return loss
    return wrapped, wrapped, step, 2


def _zero3(model, comm, lr):
    from minizero.zero.fsdp import FSDP
    from minizero.zero.fsdp_optimizer import FSDPOptimizer
    wrapped = FSDP(model, comm=comm)
    opt = FSDPOptimizer(wrapped, torch.optim.Adam, lr=lr)  # steps only this rank's shards

    def step(x, y):
        _, loss = wrapped(x, y)  # each block's parameters all-gathered just before use
        loss.backward()
        opt.step()
        return loss
    return wrapped, opt, step, 3


STRATEGIES = {"ddp": _ddp, "zero1": _zero1, "zero2": _zero2, "zero3": _zero3}


def _run_strategy(comm, strategy, steps, global_batch, lr, seed, progress):
    if comm.device.type == "cuda":  # each strategy's own high-water mark, not the previous one's
        # the previous strategy's wrapper, hooks and buffers (reference cycles) freed first
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(comm.device)
    # what the process holds before this strategy's
    # model exists (cuBLAS's workspaces, once warmed up)
    base = torch.cuda.memory_allocated(comm.device) if comm.device.type == "cuda" else None
    model = TinyGPT(GPTConfig(**DEMO_CONFIG), seed=seed).to(comm.device)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    wrapped, opt, step_fn, stage = STRATEGIES[strategy](model, comm, lr)
    data = SyntheticTokens(DEMO_CONFIG["vocab_size"], DEMO_CONFIG["block_size"], seed=seed)
    losses, times, sent = [], [], []
    bar = None
    if progress and comm.rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=steps, desc=f"{strategy:>5} on {comm.size} rank{'s' * (comm.size != 1)}",
                   file=sys.stdout, mininterval=0.2)
    for s in range(steps):
        x, y = (t.to(comm.device) for t in shard(data.batch(s, global_batch), comm.rank, comm.size))
        memory.transient.reset()
        comm.stats.reset()
        t0 = time.perf_counter()
        loss = step_fn(x, y)
        times.append(time.perf_counter() - t0)
        sent.append(comm.stats.sent())
        # the loss of the global batch = mean of the ranks' shard losses (equal shards)
        global_loss = loss.detach().clone()
        comm.all_reduce(global_loss, op="avg")
        losses.append(global_loss.item())
        if s == steps - 1:  # measured with gradients still held: the step's high-water mark
            ledger = memory.measure(wrapped, opt, device=comm.device)
        opt.zero_grad(set_to_none=True)
        if bar:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if bar:
        bar.close()
    est = memory.estimate(psi, world_size=comm.size, stage=stage, k=8, param_bytes=4, grad_bytes=4)
    ring = 2 * (comm.size - 1) / comm.size * psi * 4
    return {"strategy": strategy, "stage": stage, "psi": psi, "losses": losses, "cuda_base": base,
            "n_param_tensors": sum(1 for p in model.parameters() if p.requires_grad),
            "ledger": ledger.as_dict(),
            "estimate": {"parameters": est.parameters, "gradients": est.gradients,
                         "optimizer_state": est.optimizer_state},
            "sent_per_step": sent[-1],
            # ZeRO-3 gathers the parameters twice (forward, backward) and reduce-scatters once
            "bytes_formula": ring * (1.5 if stage == 3 else 1.0),
            "median_step_s": sorted(times)[len(times) // 2]}


def train_worker(comm, strategies=("ddp", "zero1", "zero2", "zero3"), steps=40, global_batch=32,
                 lr=3e-3, seed=0, progress=True):
    """Runs on every rank (via minizero.launch): each strategy in turn on the same data.
    Returns rank r's measurements, and on rank 0 the single-process reference curve."""
    if isinstance(strategies, str):
        strategies = [strategies]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategy {unknown}; choose from {sorted(STRATEGIES)}")
    # cuBLAS keeps a workspace per handle for the process's life (about 67 MB
    if comm.device.type == "cuda":
        # on an H200): allocate it before the first strategy so every strategy's baseline holds it
        warm = TinyGPT(GPTConfig(**DEMO_CONFIG), seed=seed).to(comm.device)
        idx = torch.zeros(2, DEMO_CONFIG["block_size"], dtype=torch.long, device=comm.device)
        warm(idx, idx)[1].backward()
        del warm, idx
    runs = [_run_strategy(comm, s, steps, global_batch, lr, seed, progress) for s in strategies]
    reference = None
    if comm.rank == 0:  # ground truth: one process, the full global batch, same init and data
        ref_model = TinyGPT(GPTConfig(**DEMO_CONFIG), seed=seed)
        ref_opt = torch.optim.Adam(ref_model.parameters(), lr=lr)
        data = SyntheticTokens(DEMO_CONFIG["vocab_size"], DEMO_CONFIG["block_size"], seed=seed)
        batches = (data.batch(s, global_batch) for s in range(steps))
        reference = _train_single(ref_model, ref_opt, batches)
    return {"rank": comm.rank, "runs": runs, "single_process_losses": reference}


def _train_single(model, optimizer, batches) -> list[float]:
    """The course's ground truth (minizero_course/experiments/references.train_single), here
    because the library never imports the course: one step per global batch, each loss."""
    losses = []
    for batch in batches:
        loss = model(*batch)[1]
        loss.backward()
        optimizer.step()
        # set_to_none: a parameter without a gradient is skipped, as in the sharded strategies
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _mb(x):
    return f"{x / 1e6:7.3f}"


def report(results, out=sys.stdout):
    """One row per strategy and rank: measured next to formula."""
    n = len(results)
    first = results[0]["runs"][0]
    print(f"\n{n} rank{'s' * (n != 1)}, TinyGPT with {first['psi']:,} parameters, fp32 Adam. MB "
          "per rank: measured by the ledger, (formula) from the estimator; bytes sent per step, "
          "(formula) from the ring model.", file=out)
    head = (f"{'strategy':>8} {'rank':>4} | {'final loss':>10} | {'params':>7} {'(formula)':>9} | "
            f"{'grads':>7} {'(formula)':>9} | {'optim':>7} {'(formula)':>9} | {'total':>7} | "
            f"{'sent/step':>9} {'(formula)':>9} | {'step ms':>7}")
    print(head + "\n" + "-" * len(head), file=out)
    ref = results[0]["single_process_losses"]
    for i, run0 in enumerate(results[0]["runs"]):
        for res in results:
            r = res["runs"][i]
            cat, e = r["ledger"]["by_category"], r["estimate"]
            # ZeRO keeps the fp32 master inside the optimizer state when it is separate: compare
            # master + optimizer state with the paper's K*Psi/N term
            optim = cat.get("optimizer_state", 0) + cat.get("master_params", 0)
            print(f"{r['strategy']:>8} {res['rank']:>4} | {r['losses'][-1]:>10.6f} | "
                  f"{_mb(cat.get('parameters', 0))} {_mb(e['parameters']):>9} | "
                  f"{_mb(cat.get('gradients', 0))} {_mb(e['gradients']):>9} | {_mb(optim)} "
                  f"{_mb(e['optimizer_state']):>9} | {_mb(r['ledger']['total'])} | "
                  f"{_mb(r['sent_per_step']):>9} {_mb(r['bytes_formula']):>9} | "
                  f"{r['median_step_s'] * 1e3:7.1f}", file=out)
    curves = [
        tuple(res["runs"][i]["losses"]) for i in range(len(results[0]["runs"])) for res in results
    ]
    same_ranks = all(len({tuple(res["runs"][i]["losses"]) for res in results}) == 1
                     for i in range(len(results[0]["runs"])))
    gap = max(abs(a - b) for c in curves for a, b in zip(c, ref))
    print(f"\nEvery rank reports the same loss curve: {same_ranks}. One process on the full batch "
          f"ends at {ref[-1]:.6f}; the largest gap of any strategy along the curve is {gap:.1e} "
          "(float summation order).",
          file=out)
    print("Measured memory exceeds the formula by Adam's 4-byte step counters and by padding to a "
          "multiple of N; ZeRO-3's sent bytes by that padding too.", file=out)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = results[0]["runs"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, r in enumerate(runs):
        a.plot(r["losses"], label=r["strategy"], lw=2.5 - 0.5 * i, alpha=0.85)
    a.plot(results[0]["single_process_losses"], color="k", lw=0.8, ls=":",
           label="1 process, full batch")
    a.set(xlabel="step", ylabel="global-batch loss", title="loss: the strategies coincide")
    a.legend()
    cats = ["parameters", "gradients", "optimizer_state"]
    names = [r["strategy"] for r in runs]
    bottom = [0.0] * len(runs)
    for cat in cats:
        vals = [
            (
                r["ledger"]["by_category"].get(cat, 0)
                + (
                    r["ledger"]["by_category"].get("master_params", 0)
                    if cat == "optimizer_state"
                    else 0
                )
            )
            / 1e6
            for r in runs
        ]
        b.bar(names, vals, bottom=bottom, label=f"{cat} (measured)")
        bottom = [x + v for x, v in zip(bottom, vals)]
    for j, r in enumerate(runs):
        est = sum(r["estimate"].values()) / 1e6
        b.hlines(est, j - 0.4, j + 0.4, color="k", lw=2, label="formula" if j == 0 else None)
    b.set(ylabel="MB per rank (rank 0)",
          title=f"model-state memory on {len(results)} rank{'s' * (len(results) != 1)}")
    b.legend(fontsize=8)
    c.bar(names, [r["sent_per_step"] / 1e6 for r in runs], color="tab:purple", label="measured")
    for j, r in enumerate(runs):
        c.hlines(r["bytes_formula"] / 1e6, j - 0.4, j + 0.4, color="k", lw=2,
                 label="formula" if j == 0 else None)
    c.set(ylabel="MB sent per rank per step", title="communication: ZeRO-3 pays 1.5x")
    c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from minizero.cli import checks
    ap = checks.Parser(prog="minizero demo", description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=checks.whole(1), default=4, help="ranks (default 4)")
    ap.add_argument("--steps", type=checks.whole(1), default=60,
                    help="training steps of each strategy (default 60)")
    ap.add_argument("--strategy", action="append", choices=sorted(STRATEGIES),
                    help="repeatable; default: ddp, zero1, zero2, zero3")
    ap.add_argument("--png", default="demo.png", help="where to write the plot")
    ap.add_argument("--timeout", type=checks.number(0, open_low=True), default=600,
                    help="seconds the job may take (default 600)")
    args = ap.parse_args(argv)
    from minizero import launch
    t0 = time.time()
    results = launch.run("minizero.cli.demo:train_worker", nprocs=args.nprocs, timeout=args.timeout,
                         stream=True,
                         args={"strategies": args.strategy or list(STRATEGIES),
                               "steps": args.steps})
    report(results)
    plot(results, args.png)
    print(f"wrote {args.png}   ({time.time() - t0:.1f}s)")
    return 0
