"""What every bench shares: how a timed step starts, how two candidates are compared, how a run ends.

    barrier(comm)         every rank starts a timed step together, waiting asleep (BARRIER_SLEEP_S
                          between polls): a rank that spins on MPICH's barrier would take a core
                          from the ranks still working, and the bench runs more ranks than cores
    step(comm, c, x, y)   one timed training step of a built candidate (candidates.py), its byte
                          counters reset first: (seconds, loss)
    paired_ratio(a, b)    the median over rounds of a[k] / b[k], two candidates timed in the same
                          round under the same machine load, with a bootstrap 95% interval
    finish(...)           the report, --json and --plot, and the run's wall time

    model_for(params)     the bench's GPT shape for about `params` parameters
    status_kb, release, fixed_mmap_threshold, reset_hwm: the process's memory as the memory runs
                          read it (RSS, its high-water mark), freed memory given back to the OS

bench.py (the DP/ZeRO bench and the `bench` command) and the sub-benches (pipeline.py,
tensor_parallel.py, three_d.py, zeropp.py) import these from here, and none of them from bench.py.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import random
import statistics
import time

from minizero_course.bench.candidates import BENCH_GPT, TORCH_STATS

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


def model_for(params=None) -> dict:
    """GPTConfig fields for about `params` parameters: BENCH_GPT's shape at width 768 (12 d^2 per block)."""
    if not params:
        return dict(BENCH_GPT)
    return dict(BENCH_GPT, n_embd=768, n_head=12, n_layer=max(1, round(params / (12 * 768 ** 2))))


# ----------------------------------------------------------------------------- process memory
def status_kb(field):
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


def release():
    """Give freed memory back to the OS, so the next RSS growth is the next candidate's own."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def fixed_mmap_threshold(nbytes=128 * 1024):
    """glibc raises its mmap threshold (up to 32 MB) each time a large block is freed, after which large
    tensors come from the heap and their memory stays in the process when freed: at 100M parameters that
    kept 0.4-0.9 GB per rank of freed tensors in the RSS (measured). A fixed threshold (mallopt
    M_MMAP_THRESHOLD) returns them to the OS; the memory run sets it for every candidate alike."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD = -3


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: VmHWM := current RSS
        return True
    except OSError:
        return False
