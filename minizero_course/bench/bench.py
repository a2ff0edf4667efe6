"""`python -m minizero_course bench`: minizero's DDP and ZeRO-1/2/3 (and ZeRO++) next to torch and DeepSpeed, measured.

One job, N ranks (default 4), the same TinyGPT, data, optimizer (torch Adam, fp32) and steps for
every candidate (minizero_course/bench/candidates.py builds them):
    minizero-ddp | minizero-zero1 | minizero-zero2 | minizero-zero3      (minizero.comm: MPI on CPU)
    minizero-zeropp (ZeRO-3 + qwZ + hpZ + qgZ, 2 simulated nodes)        (`--zeropp`: its own study)
    torch-ddp (DistributedDataParallel) | torch-fsdp2 (fully_shard)      (torch.distributed: gloo)
    deepspeed-z0 .. deepspeed-z3, when `deepspeed` imports                (its CPU accelerator: gloo)
Each library runs with its own defaults (bucket sizes, persistence thresholds), as a user gets it,
except DeepSpeed's gradient clipping (on by default in 0.19), switched off like everyone else's.

Two phases, both inside one launch:
  1. memory, one candidate at a time: build it, train 2 steps, and in step 2, between backward and
     the optimizer step (gradients and optimizer state both alive), read the ledger: memory.measure
     walking the tensors the candidate holds. Bytes of step 2: minizero.comm.stats for minizero; for
     torch and DeepSpeed every torch.distributed collective called from Python, counted with the
     SAME ring accounting (torch DDP's reducer calls C++ directly, so in this phase it gets torch's
     default all-reduce hook registered from Python: the same all-reduce, now visible). Peak RSS:
     the kernel's VmHWM, reset before the build (write "5" to /proc/self/clear_refs), minus the RSS
     before it. RSS is the whole process (Python, torch, MPI, allocator slack); the growth is what
     building and training this one candidate added, after malloc_trim returned the previous one's.
  2. time, all candidates alive, INTERLEAVED: step k of every candidate, then step k+1, ... so a
     burst of load from elsewhere on the machine hits all of them alike. Each target pair (minizero
     DDP and torch DDP, minizero ZeRO-3 and FSDP2) runs back to back, the order of the rest rotates.
     Every step starts after a barrier that sleeps rather than spins (MPICH's busy-polling would
     steal the cores from the ranks still working); a step is done when its slowest rank is. We
     report the median over steps, and the ratio to torch DDP as the median over rounds of the
     per-round ratio: paired, so drift in the machine's load cancels, with a bootstrap 95% CI.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import statistics
import sys
import time

import torch

from minizero import memory
from minizero_course.bench.common import (barrier, finish, fixed_mmap_threshold, model_for, paired_ratio,
                                          release, reset_hwm, status_kb, step)
from minizero.cli import checks
from minizero.launch import max_ranks
from minizero_course.bench.candidates import (BENCH_GPT, CANDIDATES, DEEPSPEED, DEFAULT, REFERENCE, TARGETS,
                                              TORCH_STATS, build, count_torch_collectives, start_deepspeed)
from minizero.data import shard
from minizero.models import build_model
from minizero_course.experiments.references import global_batches


# ----------------------------------------------------------------------------- the worker
def round_order(candidates, k):
    """The order of round k: each target pair (candidate, its baseline) runs back to back, which of
    the two goes first alternating with k; the blocks rotate by k, so over the rounds every
    candidate runs early and late equally often."""
    names, blocks = list(candidates), []
    for a, b, _, _ in TARGETS:
        if a in names and b in names:
            blocks.append([a, b] if k % 2 == 0 else [b, a])
            names = [n for n in names if n not in (a, b)]
    blocks += [[n] for n in names]
    blocks.sort(key=lambda blk: min(candidates.index(n) for n in blk))
    r = k % len(blocks)
    return [n for blk in blocks[r:] + blocks[:r] for n in blk]


def worker(comm, candidates=DEFAULT, steps=30, warmup=3, micro=4, lr=1e-3, seed=0, memory_steps=2,
           model_kwargs=None, memory_only=False, meta_init=False, sub_group_size=2_000_000):
    """Runs on every rank. Returns this rank's measurements for every candidate that ran.
    model_kwargs: GPTConfig fields that replace BENCH_GPT's (the test uses a smaller model).
    memory_only: phase 1 alone (a large model: all candidates alive at once would not fit).
    The disk candidates' files go to a temporary folder of this rank's, removed however the run ends."""
    import shutil
    import tempfile
    nvme_dir = tempfile.mkdtemp(prefix="minizero-bench-nvme-")
    try:
        return _measure(comm, nvme_dir, candidates, steps, warmup, micro, lr, seed, memory_steps, model_kwargs,
                        memory_only, meta_init, sub_group_size)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)


def _measure(comm, nvme_dir, candidates, steps, warmup, micro, lr, seed, memory_steps, model_kwargs, memory_only,
             meta_init, sub_group_size):
    cfg = {**BENCH_GPT, **(model_kwargs or {})}
    if memory_only:
        fixed_mmap_threshold()
    from minizero.comm import init_torch_distributed
    torch.set_num_threads(1)
    init_torch_distributed(torch.device("cpu"))  # torch DDP, FSDP2 and DeepSpeed run on gloo
    count_torch_collectives()
    out = {"rank": comm.rank, "N": comm.size, "backend": comm.backend, "model": cfg, "skipped": {}, "results": {},
           "load_average": {}}
    candidates = list(candidates)
    if any(c in DEEPSPEED for c in candidates):
        why = start_deepspeed(comm) if importlib.util.find_spec("deepspeed") else \
            "deepspeed is not installed (pip install -e '.[peers]')"
        whys = [w for w in comm.allgather_object(why) if w]
        if whys:
            out["skipped"].update(dict.fromkeys([c for c in candidates if c in DEEPSPEED], whys[0]))
            candidates = [c for c in candidates if c not in DEEPSPEED]
    dummy = torch.nn.Parameter(torch.zeros(1))  # the first Adam step imports torch._dynamo: now, not in a phase
    dummy.grad = torch.ones(1)
    torch.optim.Adam([dummy]).step()
    from minizero.zero.init import Init
    with Init():  # the shapes only: a 100M-parameter model is not built here just to count it
        model = build_model("tiny-gpt", seed=seed, **cfg)
    out["psi"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batches = [shard(b, comm.rank, comm.size) for b in global_batches(model, max(warmup + steps, memory_steps),
                                                                      micro * comm.size)]
    del model
    # phase 1: memory and bytes, one candidate at a time
    for i, name in enumerate(candidates, 1):
        _progress(comm, f"memory and bytes {i}/{len(candidates)}: {name}")
        release()
        rss0, hwm_ok = status_kb("VmRSS") * 1024, reset_hwm()
        memory.transient.reset()
        c = build(name, comm, cfg, seed, lr, micro, count_ddp=True, meta_init=meta_init, nvme_dir=nvme_dir,
                  sub_group_size=sub_group_size)
        for x, y in batches[:memory_steps - 1]:
            step(comm, c, x, y)
        comm.stats.reset()
        TORCH_STATS.reset()
        x, y = batches[memory_steps - 1]
        barrier(comm)
        c.backward(x, y)
        # gradients and optimizer state (from step 1) all exist now
        ledger = c.ledger() if c.ledger is not None else memory.measure(*c.held())
        c.update()
        # minizero on the torch backend also calls torch.distributed: count each candidate at one place only
        stats = comm.stats if c.bytes_source == "minizero.comm" else TORCH_STATS
        hwm = status_kb("VmHWM") * 1024
        out["results"][name] = {
            "rss_before": rss0, "rss_peak": hwm if hwm_ok else None,
            "rss_growth": hwm - rss0 if hwm_ok else None, "ledger": ledger.as_dict(),
            "sent_per_step": stats.sent(), "bytes_source": c.bytes_source,
            "sent_by_op": {op: v["sent_bytes"] for op, v in stats.as_dict().items() if op != "barrier"}}
        c.close()
        del c, ledger
    release()
    out["load_average"]["start"] = os.getloadavg()
    if memory_only:
        out["load_average"]["end"] = os.getloadavg()
        return out
    # phase 2: time, interleaved
    built = {name: build(name, comm, cfg, seed, lr, micro, nvme_dir=nvme_dir) for name in candidates}
    times = {name: [] for name in candidates}
    losses = {name: [] for name in candidates}
    for k, (x, y) in enumerate(batches[:warmup + steps]):
        if k % 5 == 0 or k == warmup + steps - 1:
            _progress(comm, f"time, interleaved: round {k + 1}/{warmup + steps} ({warmup} warm-up)")
        for name in round_order(candidates, k):
            t, loss = step(comm, built[name], x, y)
            if k >= warmup:
                times[name].append(t)
            losses[name].append(loss.item())
    for name in candidates:
        out["results"][name].update(times=times[name], losses=losses[name])
        built[name].close()
    out["load_average"]["end"] = os.getloadavg()
    return out


def _progress(comm, what: str) -> None:
    """One line from rank 0 as the job goes (`bench` streams the ranks' output to stderr)."""
    if comm.rank == 0:
        print(f"  bench: {what}", flush=True)


# ----------------------------------------------------------------------------- report
def summarize(per_rank: list) -> dict:
    """Per candidate: the slowest rank's time per step, its median, ratios to torch DDP, losses
    averaged over ranks (the global-batch loss), and the memory/bytes columns per rank."""
    r0 = per_rank[0]
    names = list(r0["results"])
    rows = {}
    for name in names:
        rs = [r["results"][name] for r in per_rank]
        slowest = [max(ts) for ts in zip(*(r["times"] for r in rs))]
        q = statistics.quantiles(slowest, n=4) if len(slowest) > 1 else [slowest[0]] * 3
        rows[name] = {
            "median_step_s": statistics.median(slowest), "q1_s": q[0], "q3_s": q[2], "step_s": slowest,
            "losses": [statistics.fmean(v) for v in zip(*(r["losses"] for r in rs))],
            "ledger_bytes": [r["ledger"]["total"] for r in rs], "ledger": [r["ledger"] for r in rs],
            "rss_growth": [r["rss_growth"] for r in rs], "rss_peak": [r["rss_peak"] for r in rs],
            "sent_per_step": [r["sent_per_step"] for r in rs], "sent_by_op": [r["sent_by_op"] for r in rs],
            "bytes_source": rs[0]["bytes_source"]}
    ref = rows.get(REFERENCE)
    for row in rows.values():
        row["ratio"] = row["median_step_s"] / ref["median_step_s"] if ref else None
        row["paired_ratio"], row["paired_ci95"] = paired_ratio(row["step_s"], ref["step_s"]) if ref else (None, None)
    targets = []
    for name, base, limit, what in TARGETS:
        if name in rows and base in rows:
            med, (lo, hi) = paired_ratio(rows[name]["step_s"], rows[base]["step_s"])
            verdict = "met" if hi <= limit else "missed" if lo > limit else \
                ("met by the median" if med <= limit else "missed by the median") + ", the 95% CI spans the target"
            targets.append({"what": what, "ratio": med, "ci95": [lo, hi], "limit": limit, "verdict": verdict})
    return {"N": r0["N"], "backend": r0["backend"], "psi": r0["psi"], "model": r0["model"],
            "skipped": r0["skipped"], "candidates": rows, "reference": REFERENCE if ref else None,
            "targets": targets, "load_average": r0["load_average"]}


def report(summary, out=sys.stdout):
    s, mb = summary, (lambda b: f"{b / 1e6:.2f}")
    print(f"\nbench: TinyGPT {s['model']} = {s['psi']:,} params, fp32 Adam, {s['N']} ranks, minizero on "
          f"{s['backend']}, torch/DeepSpeed on gloo", file=out)
    load = s["load_average"]
    print(f"1-min load average: {load.get('before_launch', [float('nan')])[0]:.2f} before the launch, "
          f"{load['start'][0]:.2f} at the start "
          f"and {load['end'][0]:.2f} at the end of the timing ({os.cpu_count()} cores; the bench's own {s['N']} ranks "
          f"add up to {s['N']} while they run)", file=out)
    head = (f"{'candidate':<31}| {'median ms':>9} {'IQR ms':>13} | {'/ torch-ddp [95% CI]':>20} | {'last loss':>9} | "
            f"{'ledger MB':>9} | {'RSS growth MB':>15} | {'sent MB/step':>12}  bytes counted at")
    print(head + "\n" + "-" * len(head), file=out)
    for name, r in s["candidates"].items():
        ratio = (f"{r['paired_ratio']:.3f} [{r['paired_ci95'][0]:.2f}-{r['paired_ci95'][1]:.2f}]"
                 if r["paired_ratio"] is not None else "-")
        rss = [g for g in r["rss_growth"] if g is not None]
        rss_s = f"{mb(min(rss))}-{mb(max(rss))}" if rss else "n/a"
        sent = f"{mb(max(r['sent_per_step']))}" if r["bytes_source"] != "not counted" else "not counted"
        print(f"{name:<31}| {r['median_step_s'] * 1e3:9.1f} {r['q1_s'] * 1e3:6.1f}-{r['q3_s'] * 1e3:<6.1f} | "
              f"{ratio:>20} | {r['losses'][-1]:9.5f} | {mb(max(r['ledger_bytes'])):>9} | {rss_s:>15} | {sent:>12}  "
              f"{r['bytes_source']}",
              file=out)
    for name, why in s["skipped"].items():
        print(f"{name:<31}| skipped: {why}", file=out)
    for t in s["targets"]:
        print(f"target: {t['what']}: paired step-time ratio {t['ratio']:.3f} (95% CI {t['ci95'][0]:.3f}-"
              f"{t['ci95'][1]:.3f}), limit {t['limit']:.2f}: {t['verdict']}", file=out)
    print("median: the slowest rank's step time, median over steps. / torch-ddp: median over rounds of (this / "
          "torch-ddp) in the same round (paired), bootstrap 95% CI.\nledger: bytes a rank holds after backward "
          "(gradients and optimizer state alive), walking its tensors; max over ranks.\nRSS growth: VmHWM during build "
          "+ 2 steps minus RSS before, min-max over ranks. RSS counts everything the process touched (allocator slack "
          "included).", file=out)


def cpu_adam(numel=5_000_000, repeats=5, out=sys.stdout) -> dict:
    """The CPU optimizer step offload runs, one thread: torch AdamW fused / foreach / for-loop, and
    DeepSpeed's DeepSpeedCPUAdam (its C++ AVX kernel, JIT-built) when the peers extra provides it."""
    torch.set_num_threads(1)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    impls = {f"torch AdamW {k}": (lambda ps, k=k: torch.optim.AdamW(ps, lr=1e-3, **{k: True} if k != "for-loop"
                                                                      else {"foreach": False}))
             for k in ("fused", "foreach", "for-loop")}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])  # builds the op now, not in the timing
        impls["DeepSpeedCPUAdam"] = lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, adamw_mode=True)
    except Exception as e:  # noqa: BLE001
        print(f"DeepSpeedCPUAdam: not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})", file=out)
    times = {}
    for name, make in impls.items():
        p = torch.nn.Parameter(torch.zeros(numel))
        p.grad = grad
        opt = make([p])
        opt.step()  # state allocated
        t0 = time.perf_counter()
        for _ in range(repeats):
            opt.step()
        times[name] = (time.perf_counter() - t0) / repeats
    base = times["torch AdamW fused"]
    for name, t in times.items():
        print(f"{name:<22} {t * 1e3:8.1f} ms per step of {numel:,} fp32 elements ({t / base:.2f}x fused)", file=out)
    return times


def checkpointing(repeats=7, out=sys.stdout) -> dict:
    """Activation checkpointing's price, one process: forward+backward of a TinyGPT (4 blocks, width 128,
    sequence 128, batch 8) with and without every block checkpointed, interleaved. The recompute adds
    about one forward, so the expected cost is forward / (forward + backward) of the plain step: the
    usual estimate is about 33% (backward = 2 forwards)."""
    import statistics

    from minizero_course.experiments.activation_checkpointing import step_times
    torch.set_num_threads(1)
    t = step_times(None, repeats=repeats)
    plain, ckpt, fwd = (statistics.median(t[k]) for k in ("plain", "checkpointed", "forward"))
    ratios = sorted(c / p for c, p in zip(t["checkpointed"], t["plain"]))
    result = {"plain_s": plain, "checkpointed_s": ckpt, "forward_s": fwd, "cost": ckpt / plain - 1,
              "expected_cost": fwd / plain, "paired_ratios": ratios, "usual_estimate": 1 / 3}
    print(f"forward+backward: plain {plain * 1e3:.1f} ms, checkpointed {ckpt * 1e3:.1f} ms (median of {repeats}); "
          f"cost +{result['cost']:.0%} (paired ratios {ratios[0]:.2f}-{ratios[-1]:.2f}); one forward is "
          f"{result['expected_cost']:.0%} of the plain step; the usual estimate is about 33%", file=out)
    return result


MEMORY_TARGETS = (("minizero-zero3-init", 800, "minizero ZeRO-3 with zero.Init: peak RSS <= 800 MiB per rank"),
                  ("minizero-zero3-nvme", 600, "minizero ZeRO-3 + optimizer state on disk: peak RSS <= 600 MiB"))


def memory_report(runs: dict, psi: int, out=sys.stdout) -> dict:
    """--memory-only: one fresh job per candidate (so each peak is its own); peak RSS per rank (VmHWM,
    MiB: the process's whole high-water mark), the ledger by location, and the memory targets."""
    mib = 2 ** 20
    rows = {}
    print(f"\nmemory at {psi:,} parameters, fp32 Adam, {len(next(iter(runs.values())))} ranks, 2 steps; "
          "peak RSS = VmHWM of each rank's process (whole process, MiB)", file=out)
    head = f"{'candidate':<31}| {'peak RSS MiB':>14} | {'ledger MB device/host/disk (max rank)':>38} | 1-min load"
    print(head + "\n" + "-" * len(head), file=out)
    for name, per_rank in runs.items():
        if isinstance(per_rank, str):
            print(f"{name:<31}| failed: {per_rank[:150]}", file=out)
            continue
        res = [r["results"][name] for r in per_rank]
        peaks = [r["rss_peak"] / mib for r in res]
        locs = [max(r["ledger"]["by_location"][loc] for r in res) / 1e6 for loc in ("device", "host", "disk")]
        rows[name] = {"peak_rss_mib": peaks, "by_location_mb": locs, "load": per_rank[0]["load_average"]["end"][0]}
        print(f"{name:<31}| {min(peaks):6.0f}-{max(peaks):<6.0f} | {'/'.join(f'{v:.1f}' for v in locs):>38} | "
              f"{rows[name]['load']:.1f}", file=out)
    peers = {n: max(r["peak_rss_mib"]) for n, r in rows.items() if not n.startswith("minizero")}
    targets = []
    for name, limit, what in MEMORY_TARGETS:
        if name in rows:
            worst = max(rows[name]["peak_rss_mib"])
            below = all(worst < p for p in peers.values())
            verdict = ("met" if worst <= limit and below else "missed") + \
                f" (max rank {worst:.0f} MiB; lowest peer {min(peers.values()):.0f} MiB)" if peers else \
                ("met" if worst <= limit else "missed") + f" (max rank {worst:.0f} MiB; no peer ran)"
            targets.append({"what": what, "verdict": verdict})
            print(f"target: {what}, and below every peer: {verdict}", file=out)
    return {"rows": rows, "targets": targets}


def plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = summary["candidates"]
    names = list(rows)
    colors = ["tab:blue" if n.startswith("minizero") else "tab:orange" if n.startswith("torch") else "tab:green"
              for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    med = [rows[n]["median_step_s"] * 1e3 for n in names]
    err = [[m - rows[n]["q1_s"] * 1e3 for m, n in zip(med, names)],
           [rows[n]["q3_s"] * 1e3 - m for m, n in zip(med, names)]]
    a.bar(names, med, yerr=err, color=colors, capsize=3)
    a.set(ylabel="ms per step (median, IQR)", title=f"step time, {summary['N']} ranks, interleaved")
    if summary["reference"]:
        ratio = [rows[n]["paired_ratio"] for n in names]
        ci = [[r - rows[n]["paired_ci95"][0] for r, n in zip(ratio, names)],
              [rows[n]["paired_ci95"][1] - r for r, n in zip(ratio, names)]]
        b.bar(names, ratio, yerr=ci, color=colors, capsize=3)
        b.axhline(1.0, color="k", lw=1)
        b.axhline(1.05, color="tab:red", lw=1, ls="--")
        b.set(ylabel="step time / torch-ddp (paired median, 95% CI)", title="ratio to torch DistributedDataParallel")
        # the targets beside the panel, not over its bars
        b.text(1.02, 1.0, "\n".join(f"{t['what']}: {t['ratio']:.3f} ({t['verdict'].split(',')[0]})"
                                    for t in summary["targets"]),
               transform=b.transAxes, va="top", ha="left", fontsize=7.5, bbox=dict(facecolor="white", alpha=0.8))
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=45)
        for lbl in ax.get_xticklabels():
            lbl.set_ha("right")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": the targets' box outside the axes included
    plt.close(fig)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `python -m minizero_course bench pipeline`: the schedules vs torch.distributed.pipelining
    if argv[:1] == ["pipeline"]:
        from minizero_course.bench.pipeline import main as pipeline_main
        return pipeline_main(argv[1:])
    if argv[:1] == ["3d"]:  # `python -m minizero_course bench 3d`: dp x pp x tp against pure DP on 8 ranks
        from minizero_course.bench.three_d import main as three_d_main
        return three_d_main(argv[1:])
    if argv[:1] == ["scale"]:  # `python -m minizero_course bench scale`: the largest model per strategy, cost curves
        from minizero_course.bench.scale import main as scale_main
        return scale_main(argv[1:])
    ap = checks.Parser(prog="minizero_course bench", description=__doc__.splitlines()[0],
                                 epilog="`python -m minizero_course bench pipeline --help`: the pipeline schedules vs "
                                 "torch's; "
                                        "`python -m minizero_course bench 3d --help`: 3D vs pure DP on 8 ranks; "
                                        "`python -m minizero_course bench scale --help`: the largest model "
                                        "per strategy")
    ap.add_argument("--nprocs", type=checks.whole(1, max_ranks()), default=4,
                    help="ranks (at most MINIZERO_MAX_RANKS, default 8)")
    ap.add_argument("--steps", type=checks.whole(1), default=30, help="timed steps per candidate (after --warmup)")
    ap.add_argument("--warmup", type=checks.whole(0), default=3)
    ap.add_argument("--micro", type=checks.whole(1), default=4, help="sequences per rank per step")
    ap.add_argument("--candidates", nargs="+", default=list(DEFAULT), choices=CANDIDATES, metavar="NAME",
                    help=f"any of: {' '.join(CANDIDATES)} (default: {' '.join(DEFAULT)})")
    ap.add_argument("--params", type=checks.number(0, open_low=True), default=None,
                    help="model size (e.g. 1e8): TinyGPT at width 768 with that many parameters (default: 3.2M)")
    ap.add_argument("--sub-group-size", type=checks.number(1), default=2e6,
                    help="elements per sub-group for the disk-offload candidates (DeepSpeed's sub_group_size)")
    ap.add_argument("--cpu-adam", action="store_true",
                    help="only time the CPU optimizer step: torch fused/foreach/for-loop AdamW vs DeepSpeedCPUAdam")
    ap.add_argument("--checkpointing", action="store_true",
                    help="only time activation checkpointing's recompute: step with/without, vs the usual 33%%")
    ap.add_argument("--memory-only", action="store_true",
                    help="memory phase only, one fresh job per candidate (for --params 1e8); peers built as their "
                         "docs say for large models (FSDP2 on the meta device, DeepSpeed under zero.Init)")
    ap.add_argument("--backend", choices=("mpi", "torch"), default=None,
                    help="minizero's communicator (default mpi on CPU; torch = gloo, like the torch candidates)")
    ap.add_argument("--json", default=None, help="write the summary (and every rank's raw numbers) here")
    ap.add_argument("--plot", default=None, help="write a PNG: step time bars and ratio to torch DDP")
    ap.add_argument("--timeout", type=checks.number(0, open_low=True), default=900, help="seconds per job")
    ap.add_argument("--zeropp", action="store_true", help="instead: ZeRO++ vs ZeRO-3 at 4 ranks as 2 nodes, where the "
                    "time goes, and the 300-step convergence check (minizero_course/bench/zeropp.py)")
    ap.add_argument("--convergence-steps", type=checks.whole(0), default=300,
                    help="with --zeropp: steps of the convergence check (0: timing and profile only)")
    ap.add_argument("--tp", action="store_true", help="tensor parallelism instead: minizero TP vs torch DTensor TP "
                    "at every t in (2, 4, 8) dividing --nprocs (minizero_course/bench/tensor_parallel.py; --candidates "
                    "unused, --micro = sequences per tp group, --backend default torch)")
    ap.add_argument("--model", default=None, help="with --tp: GPTConfig fields as JSON, replacing BENCH_TP_GPT's")
    ap.add_argument("--trace", default=None, metavar="DIR", help="instead: a torch.profiler Chrome trace per "
                    "candidate and rank, DIR/<candidate>-rank<k>.json, minizero's work labelled "
                    "(minizero_course/bench/trace.py)")
    ap.add_argument("--trace-steps", type=checks.whole(1), default=2,
                    help="with --trace: steps traced (after --warmup)")
    args = ap.parse_args(argv)
    checks.output_file(ap, "--json", args.json)
    checks.output_file(ap, "--plot", args.plot)
    checks.output_folder(ap, "--trace", args.trace)  # last: it makes the folder
    if args.zeropp:
        from minizero_course.bench import zeropp
        return zeropp.main(steps=args.steps, convergence_steps=args.convergence_steps, timeout=args.timeout)
    if args.trace:
        from minizero_course.bench import trace
        return trace.main(args)
    if args.tp:
        from minizero_course.bench import tensor_parallel
        return tensor_parallel.main(args)
    from minizero import launch
    t0, load_before = time.time(), os.getloadavg()
    if args.cpu_adam:
        cpu_adam()
        return 0
    if args.checkpointing:
        result = checkpointing()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    if args.memory_only:
        runs, psi = {}, None
        for name in args.candidates:
            try:
                runs[name] = launch.run("minizero_course.bench.bench:worker", nprocs=args.nprocs, timeout=args.timeout,
                                        backend=args.backend, args={"candidates": [name], "memory_only": True,
                                                                    "meta_init": True, "micro": args.micro,
                                                                    "model_kwargs": model_for(args.params),
                                                                    "sub_group_size": int(args.sub_group_size)})
                psi = runs[name][0]["psi"]
                if name in runs[name][0]["skipped"]:
                    runs[name] = runs[name][0]["skipped"][name]
            except Exception as e:  # noqa: BLE001  one candidate failing does not lose the others' figures
                runs[name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            print(f"  {name}: done ({time.time() - t0:.0f} s)", flush=True)
        result = memory_report(runs, psi or 0)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**result, "load_before": load_before, "per_candidate": runs}, f, indent=1)
        print(f"({time.time() - t0:.0f} s)")
        return 0
    print(f"bench: {len(args.candidates)} candidates on {args.nprocs} ranks: memory and bytes one at a time, then "
          f"{args.warmup + args.steps} interleaved rounds (progress on stderr; the report follows on stdout)",
          file=sys.stderr, flush=True)
    per_rank = launch.run("minizero_course.bench.bench:worker", nprocs=args.nprocs, timeout=args.timeout,
                          backend=args.backend,
                          args={"candidates": args.candidates, "steps": args.steps, "warmup": args.warmup,
                                "micro": args.micro, "model_kwargs": model_for(args.params)}, stream=sys.stderr)
    summary = summarize(per_rank)
    summary["load_average"]["before_launch"] = load_before
    return finish(args, summary, per_rank, report, plot, t0)

