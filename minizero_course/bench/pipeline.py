"""`python -m minizero_course bench pipeline`: minizero's schedules next to torch.distributed.pipelining's.

One job, p ranks (default 4), the same TinyGPT cut into the same stages (one block per virtual
stage), the same micro-batches, the same data, for every candidate:
    minizero-<schedule>        minizero's runtime on minizero.comm (MPI on CPU)
    minizero-gloo-<schedule>   the same runtime on minizero's torch backend (gloo), torch's transport
    torch-<schedule>           torch.distributed.pipelining (gloo): ScheduleGPipe, Schedule1F1B,
                               ScheduleInterleaved1F1B (v = 2), ScheduleInterleavedZeroBubble with one
                               stage per rank (its warm-up and W deferral are ZB-H1's)
Only the pipeline step is timed (forward and backward of every micro-batch; gradients zeroed after,
untimed): no optimizer, no data parallelism, so the ratio is the schedules' and runtimes' own.
Ground truth: the weights are the same (one seed), so the last step's gradients of every rank must
equal torch's; the table gives the atol that needs at rtol 1e-6 ("grad vs torch").
Interleaved: step k of every candidate, then step k+1, each after a sleeping barrier, minizero's and
torch's run of a schedule back to back (who goes first alternating), the blocks rotating with k
(round_order); a step is done when its slowest rank is. Ratio: median over rounds of minizero /
torch in the same round (paired), with a bootstrap 95% CI (common.paired_ratio).

Memory: the peak bytes autograd holds for backward during one step, per rank, counted by the same
meter for every candidate (memory.SavedTensors: a saved-tensors hook whose packed objects report
when autograd frees them; storages once, parameters excluded). minizero's runtime, which meters
itself the same way, is told not to (hooks do not nest), so one outer meter sees both alike.

Then the bubble: minizero's schedules on the emulated device (experiments.pipeline.TimedBlock:
stages that wait F = B = W ms instead of computing, so 4 ranks on 2 cores do not slow each other
down) measured from the real per-rank events, against the papers' formulas, with the load average.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from minizero import memory
from minizero_course.bench.common import barrier, finish, paired_ratio

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
TORCH_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
               "zb_h1": "ScheduleInterleavedZeroBubble"}
BENCH_PIPE_GPT = dict(vocab_size=64, block_size=32, n_head=4, n_embd=128, tie_weights=False)
TARGETS = (("minizero-1f1b", "torch-1f1b", 1.0), ("minizero-gpipe", "torch-gpipe", 1.0))


def _candidates(comm, gloo_comm, p, m, micro, schedules):
    """name -> (step(x, y), parameters) for every candidate; each builds its own TinyGPT (same seed)."""
    from torch.distributed import pipelining

    from minizero.comm import Mesh
    from minizero.models import GPTConfig, TinyGPT
    from minizero.pipeline import PipelineRuntime, PipelineStage
    out = {}
    for schedule in schedules:
        v = 2 if schedule == "interleaved_1f1b" else 1
        cfg = GPTConfig(**BENCH_PIPE_GPT, n_layer=p * v)
        shape = (micro, cfg.block_size, cfg.n_embd)
        for name, c in ((f"minizero-{schedule}", comm), (f"minizero-gloo-{schedule}", gloo_comm)):
            stage = PipelineStage(TinyGPT(cfg).pipeline_parts(), Mesh(c, pp=p), shape, num_chunks=v)
            pipe = PipelineRuntime(stage, schedule, m, measure=False)
            out[name] = (lambda x, y, pipe=pipe: pipe.step(x, y), stage)
        stage = PipelineStage(TinyGPT(cfg).pipeline_parts(), Mesh(comm, pp=p), shape, num_chunks=v)  # the same cut
        stages = [pipelining.PipelineStage(chunk, chunk.index, p * v, torch.device("cpu")) for chunk in stage.chunks]
        cls = getattr(pipelining, TORCH_CLASS[schedule])
        sched = cls(stages if schedule in ("interleaved_1f1b", "zb_h1") else stages[0], m, loss_fn=stage.loss_fn)
        first, last = stage.is_first(0), any(stage.is_last(k) for k in range(v))

        def torch_step(x, y, sched=sched, first=first, last=last):
            losses = []
            sched.step(*((x,) if first else ()), **({"target": y, "losses": losses} if last else {}))
            return torch.stack(losses).mean() if losses else None
        out[f"torch-{schedule}"] = (torch_step, stage)
    return out


def round_order(names, k):
    """Round k's order: minizero-<s> and torch-<s> back to back (which goes first alternating with k), the
    gloo runtime a block of its own, the blocks rotating with k. In a plain rotation of all candidates the
    pair's ratio moved with what ran between them: 1F1B / torch 0.78 [0.74-0.90] with no gloo candidate in
    the job, 1.12 [1.02-1.28] with one (two 20-step jobs a few minutes apart, load 19-25)."""
    blocks, rest = [], list(names)
    for schedule in SCHEDULES:
        pair = [f"minizero-{schedule}", f"torch-{schedule}"]
        if all(n in rest for n in pair):
            blocks.append(pair if k % 2 == 0 else pair[::-1])
            rest = [n for n in rest if n not in pair]
    blocks += [[n] for n in rest]
    r = k % len(blocks)
    return [n for block in blocks[r:] + blocks[:r] for n in block]


def worker(comm, schedules=SCHEDULES, m=8, micro=4, steps=10, warmup=2, timed_ms=(4.0, 4.0, 4.0), timed_steps=4):
    from minizero.comm import Communicator, init_torch_distributed
    from minizero.comm.backends import TorchBackend
    from minizero_course.experiments.pipeline import train
    from minizero_course.experiments.references import global_batches
    from minizero.models import GPTConfig, TinyGPT
    torch.set_num_threads(1)
    init_torch_distributed(torch.device("cpu"))
    gloo = Communicator("torch", TorchBackend(), torch.device("cpu"), name="gloo")
    p = comm.size
    built = _candidates(comm, gloo, p, m, micro, schedules)
    names = list(built)
    batches = global_batches(TinyGPT(GPTConfig(**BENCH_PIPE_GPT, n_layer=p)), warmup + steps, micro * m, seed=1)
    out = {"rank": comm.rank, "p": p, "m": m, "micro": micro, "model": BENCH_PIPE_GPT, "times": {n: [] for n in names},
           "losses": {n: [] for n in names}, "saved_peak": {}, "load_average": {"start": os.getloadavg()}}
    grads = {}                                                      # name -> this rank's flat gradients, last step
    for k, (x, y) in enumerate(batches):
        for name in round_order(names, k):
            step, stage = built[name]
            meter = memory.SavedTensors(exclude=stage.parameters())
            barrier(comm)
            t0 = time.perf_counter()
            with meter.hooks():
                loss = step(x, y)
            dt = time.perf_counter() - t0
            if k == len(batches) - 1:  # the last step's gradients, to compare with torch's (same weights, same data)
                grads[name] = torch.cat([q.grad.flatten() for q in stage.parameters()])
            for q in stage.parameters():
                q.grad = None
            if k >= warmup:
                out["times"][name].append(dt)
            out["losses"][name].append(None if loss is None else loss.item())
            out["saved_peak"][name] = max(out["saved_peak"].get(name, 0), meter.peak)
    out["load_average"]["end"] = os.getloadavg()
    # ground truth: this rank's gradients against torch.distributed.pipelining's, atol needed at rtol 1e-6
    out["grad_atol_vs_torch"] = {}
    for name, g in grads.items():
        ref = grads["torch-" + name.split("-")[-1]]
        out["grad_atol_vs_torch"][name] = ((g - ref).abs() - 1e-6 * ref.abs()).max().item()
    # the bubble on the emulated device, from real events (experiments.pipeline.train, timed_ms per stage)
    out["bubble"] = {s: train(comm, s, p, m, 2 if s == "interleaved_1f1b" else 1, steps=timed_steps, timed_ms=timed_ms,
                              reference=False)["events"] for s in schedules}
    out["load_average"]["after_bubble"] = os.getloadavg()
    return out


def summarize(per_rank: list) -> dict:
    from minizero.pipeline import bubble, bubble_formula
    r0 = per_rank[0]
    rows = {}
    for name in r0["times"]:
        slowest = [max(ts) for ts in zip(*(r["times"][name] for r in per_rank))]
        last = [r["losses"][name] for r in per_rank if r["losses"][name][-1] is not None][0]
        rows[name] = {"median_step_s": statistics.median(slowest), "step_s": slowest, "last_loss": last[-1],
                      "saved_peak": [r["saved_peak"][name] for r in per_rank],
                      "grad_atol_vs_torch": max(r["grad_atol_vs_torch"][name] for r in per_rank)}
    targets = []
    for name, base, limit in TARGETS:
        if name in rows and base in rows:
            med, (lo, hi) = paired_ratio(rows[name]["step_s"], rows[base]["step_s"])
            targets.append({"what": f"{name} / {base}", "ratio": med, "ci95": [lo, hi], "limit": limit,
                            "verdict": "met" if hi <= limit else "missed" if lo > limit else
                            ("met by the median" if med <= limit else "missed by the median") + ", the CI spans it"})
    for name, row in rows.items():
        base = "torch-" + name.split("-")[-1]
        row["paired_ratio"] = paired_ratio(row["step_s"], rows[base]["step_s"]) if base in rows else None
    bubbles = {}
    for s in r0["bubble"]:
        steps = [bubble([r["bubble"][s][k] for r in per_rank])["bubble"] for k in range(1, len(r0["bubble"][s]))]
        v = 2 if s == "interleaved_1f1b" else 1
        bubbles[s] = {"measured": statistics.median(steps), "steps": steps,
                      "formula": bubble_formula(s, r0["p"], r0["m"], v)}
    return {"p": r0["p"], "m": r0["m"], "micro": r0["micro"], "model": r0["model"], "candidates": rows,
            "targets": targets, "bubble": bubbles, "load_average": r0["load_average"]}


def report(s, out=sys.stdout):
    load = s["load_average"]
    print(f"\nbench pipeline: TinyGPT {s['model']}, one block per virtual stage, p={s['p']} ranks, m={s['m']} "
          f"micro-batches of {s['micro']}; pipeline step only (forward + backward of every micro-batch)", file=out)
    print(f"1-min load average: {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end of the timing "
          f"({os.cpu_count()} cores; the bench's own {s['p']} ranks add up to {s['p']})", file=out)
    head = (f"{'candidate':<28}| {'median ms':>9} | {'/ torch [95% CI]':>20} | {'loss':>8} | {'grad vs torch':>13} | "
            f"{'saved-for-backward peak KB per rank':>36}")
    print(head + "\n" + "-" * len(head), file=out)
    for name, r in s["candidates"].items():
        pr = r["paired_ratio"]
        ratio = f"{pr[0]:.3f} [{pr[1][0]:.2f}-{pr[1][1]:.2f}]" if pr else "-"
        peaks = " ".join(f"{b / 1e3:.0f}" for b in r["saved_peak"])
        print(f"{name:<28}| {r['median_step_s'] * 1e3:9.1f} | {ratio:>20} | {r['last_loss']:8.5f} | "
              f"{r['grad_atol_vs_torch']:13.1e} | {peaks:>36}", file=out)
    for t in s["targets"]:
        print(f"target {t['what']} <= {t['limit']:.2f}: {t['ratio']:.3f} (95% CI "
              f"{t['ci95'][0]:.3f}-{t['ci95'][1]:.3f}): {t['verdict']}", file=out)
    print(f"\nbubble on the emulated device (stages wait instead of computing), p={s['p']}, m={s['m']}; 1-min load "
          f"{load['after_bubble'][0]:.2f} after:", file=out)
    for name, b in s["bubble"].items():
        print(f"  {name:<18} measured {b['measured']:.3f} (median of {len(b['steps'])} steps)  formula "
              f"{b['formula']:.3f}  difference {b['measured'] - b['formula']:+.3f}", file=out)


def main(argv=None) -> int:
    from minizero.cli import checks
    ap = checks.Parser(prog="minizero_course bench pipeline", description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=4, help="pipeline stages (= ranks)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    from minizero import launch
    t0 = time.time()
    print(f"bench pipeline: {len(args.schedules)} schedules, minizero's and torch's, on {args.nprocs} ranks: "
          f"{args.warmup + args.steps} interleaved steps each, then the bubble on the emulated device (one job; "
          "the report follows when it ends)", file=sys.stderr, flush=True)
    per_rank = launch.run("minizero_course.bench.pipeline:worker", nprocs=args.nprocs, timeout=args.timeout,
                          args={"schedules": args.schedules, "m": args.microbatches, "micro": args.micro,
                                "steps": args.steps, "warmup": args.warmup})
    return finish(args, summarize(per_rank), per_rank, report, None, t0)
