"""`python -m minizero_course bench 3d`: 3D parallelism (dp x pp x tp, ZeRO-1) against pure data parallelism.

One 8-rank job (2 simulated nodes of 4) trains the bench model (BENCH_GPT, fp32, SGD with momentum) in both
layouts through minizero.initialize, interleaved step by step (minizero_course/experiments/three_d.py):
    dp8-zero1            ZeRO-1 over all 8 ranks
    dp2-pp2-tp2-zero1    tp 2 inside a node, 2 pipeline stages (1F1B), ZeRO-1 over the 2 replicas
It reports the paired step-time ratio (3D / DP, median over rounds with a bootstrap 95% CI), and every
rank's bytes per step by group and by link (intra-/cross-node, comm.stats) next to the planner's
prediction for its stage. The target: 3D's bytes per step equal the planner's (up to the engine's
one-element collectives: the loss broadcast and the gradient-norm all-reduces, a few bytes).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

from minizero_course.bench.common import finish, paired_ratio
from minizero_course.bench.candidates import BENCH_GPT
from minizero_course.experiments.three_d import LAYOUTS

ONE_ELEMENT_BYTES = 16  # at most 4 one-element fp32 collectives per step that the planner leaves out


def summarize(per_rank: list) -> dict:
    names = [res["layout"]["name"] for res in per_rank[0]]
    steps = {name: per_rank[0][i]["step_s"] for i, name in enumerate(names)}  # the slowest rank's, all alike
    ratio, ci = paired_ratio(steps[names[1]], steps[names[0]])
    rows = []
    for rank, results in enumerate(per_rank):
        for res in results:
            measured, planned = res["sent"], res["planned"]
            diff = sum(measured["by_group"].values()) - sum(planned["by_group"].values())
            rows.append({"rank": rank, "layout": res["layout"]["name"], "coords": res["coords"],
                         "sent": measured, "planned": planned, "extra_bytes": diff})
    return {"layouts": names, "median_ms": {n: 1e3 * statistics.median(s) for n, s in steps.items()},
            "ratio": ratio, "ci": ci, "rows": rows,
            "losses_equal": all(abs(a - b) <= 1e-5 * abs(b) for rank in per_rank for r in rank
                                for a, b in zip(r["losses"], per_rank[0][0]["losses"])),
            "bytes_as_planned": all(0 <= r["extra_bytes"] <= ONE_ELEMENT_BYTES for r in rows)}


def report(s: dict) -> None:
    print(f"\n3D vs DP, 8 ranks as 2 nodes of 4, TinyGPT {BENCH_GPT}, fp32 SGD; 1-min load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name in s["layouts"]:
        print(f"  {name:20} median step {s['median_ms'][name]:8.1f} ms (the slowest rank's)")
    lo, hi = s["ci"]
    print(f"  3D / DP paired step-time ratio {s['ratio']:.2f} [95% CI {lo:.2f}-{hi:.2f}]")
    for name in s["layouts"]:
        rows = [r for r in s["rows"] if r["layout"] == name]
        calls = sorted({r["sent"]["calls"] for r in rows})
        sent = max(sum(r["sent"]["by_group"].values()) for r in rows)
        print(f"  {name:20} per rank and step: {sent / 1e6:.2f} MB sent at most, {calls[0]}-{calls[-1]} collectives "
              "and p2p messages (each waits for its peers to be scheduled)")
    print(f"\n{'layout':20} {'rank':>4} {'(d,p,t)':>9} | {'sent by group, measured (planned) B':55} | "
          f"{'intra-node':>10} {'cross-node':>10} | planned intra / cross")
    for r in s["rows"]:
        groups = ", ".join(f"{g} {b:.0f} ({r['planned']['by_group'].get(g, 0):.0f})"
                           for g, b in r["sent"]["by_group"].items() if b)
        link, plink = r["sent"]["by_link"], r["planned"]["by_link"]
        print(f"{r['layout']:20} {r['rank']:4} {str(tuple(r['coords'])):>9} | {groups:55} | "
              f"{link['intra-node']:10.0f} {link['cross-node']:10.0f} | {plink['intra-node']:.0f} / "
              f"{plink['cross-node']:.0f}")
    print(f"\nevery rank's and layout's losses equal (rel 1e-5; one global batch): {s['losses_equal']}")
    print(f"bytes per step = the planner's + at most {ONE_ELEMENT_BYTES} B on every rank: {s['bytes_as_planned']} "
          "(the planner books a group's bytes under the slowest link it uses; the measurement shows which ranks' "
          "bytes really cross: in a ring over 2 nodes, the two ranks at the node boundary)")


def main(argv=None) -> int:
    from minizero.cli import checks
    ap = checks.Parser(prog="minizero_course bench 3d", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per layout (after one warm-up step)")
    ap.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    from minizero import launch
    t0 = time.time()
    print(f"bench 3d: dp 8 and dp 2 x pp 2 x tp 2 on 8 ranks, {args.steps + 1} interleaved steps each (one job; the "
          "report follows when it ends)", file=sys.stderr, flush=True)
    per_rank = launch.run("minizero_course.experiments.three_d:run", nprocs=8, timeout=args.timeout,
                          args={"layouts": LAYOUTS, "model_cfg": BENCH_GPT, "global_batch": 8 * args.micro,
                                "micro": args.micro, "steps": args.steps})
    summary = summarize(per_rank)
    finish(args, summary, per_rank, report, None, t0)
    return 0 if summary["bytes_as_planned"] and summary["losses_equal"] else 1
