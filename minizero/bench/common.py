"""What every bench shares: how a timed step starts, how two candidates are compared, how a run ends.

    barrier(comm)         every rank starts a timed step together, waiting asleep (BARRIER_SLEEP_S
                          between polls): a rank that spins on MPICH's barrier would take a core
                          from the ranks still working, and the bench runs more ranks than cores
    step(comm, c, x, y)   one timed training step of a built candidate (candidates.py), its byte
                          counters reset first: (seconds, loss)
    paired_ratio(a, b)    the median over rounds of a[k] / b[k], two candidates timed in the same
                          round under the same machine load, with a bootstrap 95% interval
    finish(...)           the report, --json and --plot, and the run's wall time

bench.py (the DP/ZeRO bench and the `bench` command) and the sub-benches (pipeline.py,
tensor_parallel.py, three_d.py, zeropp.py) import these from here, and none of them from bench.py.
"""
from __future__ import annotations

import json
import random
import statistics
import time

from minizero.bench.candidates import TORCH_STATS

BARRIER_SLEEP_S = 0.0002  # between two polls of the barrier: short next to any step the bench times


def barrier(comm):
    """A barrier that sleeps while it waits (Communicator.barrier(sleep_s=...))."""
    comm.barrier(sleep_s=BARRIER_SLEEP_S)


def step(comm, c, x, y):
    """Forward, backward and update of candidate `c` on (x, y), timed from after a barrier; the
    bytes counters (minizero's and torch's) start from zero. Returns (seconds, detached loss)."""
    comm.stats.reset()
    TORCH_STATS.reset()
    barrier(comm)
    t0 = time.perf_counter()
    loss = c.backward(x, y)
    c.update()
    return time.perf_counter() - t0, loss.detach()


def paired_ratio(a, b, resamples=2000):
    """Median over steps of a[k] / b[k] (the same round, so the same machine load), with a
    percentile-bootstrap 95% interval of that median."""
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), (boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1])


def finish(args, summary, per_rank, report_fn, plot_fn, t0) -> int:
    """Print the report; write --json (the summary and every rank's raw numbers) and --plot."""
    report_fn(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "per_rank": per_rank}, f, indent=1)
        print(f"wrote {args.json}")
    if getattr(args, "plot", None):
        plot_fn(summary, args.plot)
        print(f"wrote {args.plot}")
    print(f"({time.time() - t0:.0f} s)")
    return 0
