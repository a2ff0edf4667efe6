"""`python -m minizero_course bench --zeropp`: ZeRO++ (qwZ + hpZ + qgZ) against plain ZeRO-3, 4 ranks as 2 nodes.

Two launches:
  1. `worker`: the bench model (candidates.BENCH_GPT) under minizero-zero3 and minizero-zeropp, built
     as bench.py builds them, interleaved step by step (paired ratios with a bootstrap CI, as in
     bench.py; target <= 1.25x). Then WHERE THE TIME GOES: cProfile on every rank for a few more steps
     of each, split into quantize/dequantize (cumulative time in quantize.py's four kernels), waiting in
     MPI (the time inside mpi4py's calls) and the rest (forward/backward compute, Python). cProfile adds
     its own overhead per Python call; the split is for comparing the two, not absolute.
  2. experiments.zeropp.convergence for 300 steps (--convergence-steps) on lesson 08's model, every variant:
     the mean of the last 100 losses against ZeRO-3's, DeepSpeed's own ZeRO++ criterion (its
     TestZeroPPConvergence: 500 steps, qwZ + hpZ, strictly below 1.1x).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

from minizero_course.bench.common import barrier, paired_ratio, step
from minizero_course.bench.candidates import BENCH_GPT, build
from minizero.data import shard
from minizero_course.experiments.references import global_batches
from minizero.models import build_model

PAIR = ("minizero-zero3", "minizero-zeropp")
KERNELS = ("quantize_blockwise", "dequantize_blockwise", "pack_int4", "unpack_int4")
LIMIT = 1.25


def _split(profile) -> dict:
    """Seconds in quantize.py's kernels (cumulative) and in comm/backends.py's functions (own time:
    mpi4py's Cython calls are invisible to cProfile, so their time lands in the Python function that
    made them, a Work.wait or an MPIBackend op)."""
    stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, ncalls, own s, cumulative s, callers)}
    quant = sum(v[3] for (f, _, name), v in stats.items() if f.endswith("quantize.py") and name in KERNELS)
    mpi = sum(v[2] for (f, _, _), v in stats.items() if f.endswith("comm/backends.py"))
    return {"quantize": quant, "mpi": mpi}


def worker(comm, steps=20, warmup=3, micro=4, profile_steps=4, lr=1e-3):
    torch.set_num_threads(1)
    dummy = torch.nn.Parameter(torch.zeros(1))  # the first Adam step imports torch._dynamo: now, not timed
    dummy.grad = torch.ones(1)
    torch.optim.Adam([dummy]).step()
    built = {name: build(name, comm, BENCH_GPT, 0, lr, micro) for name in PAIR}
    net = build_model("tiny-gpt", seed=0, **BENCH_GPT)
    batches = [shard(b, comm.rank, comm.size) for b in global_batches(net, warmup + steps + profile_steps,
                                                                       micro * comm.size)]
    times = {name: [] for name in PAIR}
    for k, (x, y) in enumerate(batches[:warmup + steps]):
        for name in (PAIR if k % 2 == 0 else PAIR[::-1]):  # who goes first alternates
            t, _ = step(comm, built[name], x, y)
            if k >= warmup:
                times[name].append(t)
    where = {}
    for name in PAIR:
        profile, t = cProfile.Profile(), 0.0
        for x, y in batches[warmup + steps:]:
            barrier(comm)
            profile.enable()
            t0 = time.perf_counter()
            built[name].backward(x, y)
            built[name].update()
            t += time.perf_counter() - t0
            profile.disable()
        where[name] = {**_split(profile), "total": t}
    return {"times": times, "where": where, "N": comm.size}


def quantize_cost(psi, n=4, k=2, weight_block_numel=2048, grad_block_numel=512, repeats=10) -> dict:
    """One rank's quantization work per ZeRO++ step, timed alone in this process (one thread, no
    collective; best of `repeats`, in this thread's CPU time: wall time on a loaded machine measured the
    other jobs, e.g. 25-37 ms for a hop-1 encode that takes ~6 ms of CPU), for psi parameters as one
    unit: qwZ encodes its shard (int8) and decodes the n gathered rows; qgZ reorders the gradient, encodes
    k rows of psi/k (int4) and decode-sums what arrives, then encodes the node sum as nodes rows and
    decode-sums again."""
    from minizero.zero import quantize
    torch.set_num_threads(1)
    s, nodes = psi // n, n // k
    shard, grad = torch.randn(s), torch.randn(n * s)
    gathered = quantize.encode(shard, weight_block_numel, 8).expand(n, -1).contiguous()
    rows = grad.view(nodes, k, s).transpose(0, 1).reshape(k, nodes * s)
    hop1 = quantize.encode(rows, grad_block_numel, 4)
    hop2 = quantize.encode(rows[0].view(nodes, s), grad_block_numel, 4)
    work = {"weights: encode the shard": lambda: quantize.encode(shard, weight_block_numel, 8),
            "weights: decode n rows": lambda: quantize.decode(gathered, s, weight_block_numel, 8,
                                                                out=torch.empty(n, s)),
            "gradients: reorder": lambda: grad.view(nodes, k, s).transpose(0, 1).reshape(k, nodes * s),
            "gradients: hop 1 encode": lambda: quantize.encode(rows, grad_block_numel, 4),
            "gradients: hop 1 decode + sum": lambda: quantize.decode(hop1, nodes * s, grad_block_numel, 4,
                                                                       sum_rows=True),
            "gradients: hop 2 encode": lambda: quantize.encode(rows[0].view(nodes, s), grad_block_numel, 4),
            "gradients: hop 2 decode + sum": lambda: quantize.decode(hop2, s, grad_block_numel, 4, sum_rows=True)}
    best = {}
    for name, fn in work.items():
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.thread_time()
            fn()
            times.append(time.thread_time() - t0)
        best[name] = min(times)
    return best


def main(steps=20, convergence_steps=300, timeout=900):
    from minizero import launch
    t0 = time.time()
    print(f"bench --zeropp: ZeRO-3 and ZeRO++ on 4 ranks as 2 nodes, {steps} interleaved steps each, then a profile"
          + (f", then {convergence_steps} steps of every variant for convergence" if convergence_steps > 0 else "")
          + " (the report follows each part)", file=sys.stderr, flush=True)
    per_rank = launch.run("minizero_course.bench.zeropp:worker", nprocs=4, args={"steps": steps}, timeout=timeout)
    slowest = {n: [max(ts) for ts in zip(*(r["times"][n] for r in per_rank))] for n in PAIR}
    ratio, (lo, hi) = paired_ratio(slowest[PAIR[1]], slowest[PAIR[0]])
    print(f"\nZeRO++ (qwZ + hpZ + qgZ) vs ZeRO-3, TinyGPT {BENCH_GPT}, 4 ranks as 2 nodes x 2, fp32 Adam")
    for n in PAIR:
        print(f"  {n:<16} median step {statistics.median(slowest[n]) * 1e3:7.1f} ms")
    verdict = "met" if hi <= LIMIT else "missed" if lo > LIMIT else "undecided (the 95% CI spans it)"
    print(f"target: paired step-time ratio {ratio:.3f} (95% CI {lo:.3f}-{hi:.3f}), limit {LIMIT}: {verdict}")
    print(f"where the time goes (cProfile, {len(per_rank)} ranks, mean per step, ms):")
    print(f"  {'':<16} {'total':>8} {'quantize':>9} {'in MPI':>8} {'the rest':>9}")
    for n in PAIR:
        w = [r["where"][n] for r in per_rank]
        k = len(w)
        tot, q, m = (sum(x[key] for x in w) / k for key in ("total", "quantize", "mpi"))
        print(f"  {n:<16} {tot * 1e3:8.1f} {q * 1e3:9.1f} {m * 1e3:8.1f} {(tot - q - m) * 1e3:9.1f}")
    psi = sum(p.numel() for p in build_model("tiny-gpt", seed=0, **BENCH_GPT).parameters())
    cost = quantize_cost(psi)
    print(f"one rank's quantization work per step, alone in one process (Psi = {psi:,} as one unit, best of 10, CPU "
          "ms):")
    print("  " + ", ".join(f"{name} {t * 1e3:.1f}" for name, t in cost.items())
          + f"; total {sum(cost.values()) * 1e3:.1f}")
    print(f"load average (1/5/15 min): {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    if convergence_steps <= 0:
        print(f"({time.time() - t0:.0f} s; convergence check skipped)")
        return 0
    conv = launch.run("minizero_course.experiments.zeropp:convergence", nprocs=4, args={"steps": convergence_steps},
                      timeout=timeout)[0]
    last = min(100, convergence_steps // 3)
    base = statistics.fmean(conv["ZeRO-3"]["loss"][-last:])
    print(f"convergence, lesson 08's model, {convergence_steps} steps: mean of the last {last} losses (DeepSpeed: "
          "< 1.1x the baseline's after 500 steps, qwZ + hpZ)")
    for name, r in conv.items():
        mean = statistics.fmean(r["loss"][-last:])
        weights = [e for e in r["weight_error"] if e is not None]
        grads = [e for _, e in r["grad_error"]]
        fmt = lambda v: f"{statistics.fmean(v):.2e}" if v else "-"  # noqa: E731
        print(f"  {name:<8} {mean:.4f}  {mean / base:.4f}x   relative error per step: weights {fmt(weights)}, "
              f"gradients {fmt(grads)}")
    print(f"({time.time() - t0:.0f} s)")
    return 0
