"""`python -m minizero_course bench --trace DIR`: a torch.profiler Chrome trace per candidate and rank, to open in
Perfetto (ui.perfetto.dev) or chrome://tracing.

Each rank builds the candidates of `bench` one at a time (candidates.py, the same builds the timings
use), runs --warmup untraced steps, then --trace-steps steps under torch.profiler (CPU activity), and
writes DIR/<candidate>-rank<k>.json. minizero's own work is labelled (minizero/comm/labels.py):

    mz.step / mz.backward / mz.update       this driver: a step, its forward+backward(+sync), its optimizer
    mz.<op>                                 every Communicator collective: mz.all_reduce, mz.all_gather, ...
    mz.wait                                 a rank blocked on an async handle (exposed communication)
    mz.bucket.launch                        DDP / ZeRO-2 starting a bucket's reduction
    mz.fsdp.gather                          ZeRO-3 starting a unit's all-gather
    mz.offload.d2h / h2d / cpu_step         ZeRO-Offload's copies and its CPU step (DPU: on its own thread)
    mz.disk.read / mz.disk.write            ZeRO-Infinity's files (on its I/O threads)

torch's profiler records ranges on the thread that started it only; ranges on other threads (the DPU
step, the disk pool) are kept by comm/labels.py and written into the same trace here, with their own
thread ids, on the profiler's clock (time.time_ns; ts = ns since the trace's baseTimeNanoseconds, in us).

Each rank also returns, per candidate, the count of every mz.* label in its trace and the calls per
collective minizero.comm counted in the same steps (tests/test_trace.py checks they agree), and the
overlap figures of `overlap()`.

Overhead: `python -m minizero_course.bench.trace --overhead` times a label with no profiler running.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import Counter

import torch

from minizero_course.bench.common import step
from minizero_course.bench.candidates import BENCH_GPT, build
from minizero.comm import labels
from minizero.data import shard
from minizero_course.experiments.references import global_batches
from minizero.models import build_model

COMM_LABELS = ("mz.all_reduce", "mz.reduce_scatter", "mz.all_gather", "mz.broadcast", "mz.reduce", "mz.all_to_all",
               "mz.send", "mz.recv", "mz.wait")


def _profiled_step(comm, c, x, y, calls: Counter):
    with torch.profiler.record_function("mz.step"):
        comm.stats.reset()
        with torch.profiler.record_function("mz.backward"):
            loss = c.backward(x, y)
        with torch.profiler.record_function("mz.update"):
            c.update()
    _add_calls(comm, calls)
    return loss.detach()


def _add_calls(comm, calls: Counter):
    """Add minizero.comm's calls per op since the last reset to `calls`, and reset."""
    for op, s in comm.stats.ops.items():
        calls[op] += s.calls
    comm.stats.reset()


def _write(prof, thread_ranges, path):
    """Export the profiler's trace, add the other threads' ranges, write `path`; return its events."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        raw = tmp.name
    try:
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            trace = json.load(f)
    finally:
        os.unlink(raw)
    base_ns = trace.get("baseTimeNanoseconds", 0)
    pid = next((e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"), os.getpid())
    for name, tid, start, end in thread_ranges:
        trace["traceEvents"].append({"ph": "X", "cat": "mz_thread", "name": name, "pid": pid, "tid": tid,
                                     "ts": (start - base_ns) / 1e3, "dur": (end - start) / 1e3})
    with open(path, "w") as f:
        json.dump(trace, f)
    return trace["traceEvents"]


def mz_ranges(events):
    """[(name, tid, start_us, end_us)] of the mz.* complete events of a trace, sorted by start."""
    return sorted(((e["name"], e.get("tid"), e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and str(e.get("name", "")).startswith("mz.")), key=lambda r: r[2])


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _covered(intervals, by):
    """Length of `intervals` (a union) that lies inside `by` (a union)."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in intervals for c, d in by)


def overlap(events) -> dict:
    """What the trace says about overlap, per rank, in us:
    step: total mz.step time; blocked: time the main thread sat in mz.wait or a blocking collective
    (communication nobody hid); thread: time of ranges on other threads (DPU step, disk I/O) and the
    fraction of it that ran while the main thread was inside mz.backward (hidden behind compute)."""
    ranges = mz_ranges(events)
    main = next((tid for name, tid, *_ in ranges if name == "mz.step"), None)
    steps = _union([(a, b) for n, t, a, b in ranges if n == "mz.step"])
    backward = _union([(a, b) for n, t, a, b in ranges if n == "mz.backward"])
    comm = _union([(a, b) for n, t, a, b in ranges if t == main and n in COMM_LABELS])
    blocked = _union([(a, b) for n, t, a, b in ranges if t == main and n == "mz.wait"])  # blocking ops wait too
    thread = _union([(a, b) for n, t, a, b in ranges if t != main])
    thread_s = sum(b - a for a, b in thread)
    return {"step_us": sum(b - a for a, b in steps), "comm_us": sum(b - a for a, b in comm),
            "blocked_us": sum(b - a for a, b in blocked), "thread_us": thread_s,
            "thread_hidden_fraction": _covered(thread, backward) / thread_s if thread_s else None}


def worker(comm, trace_dir, candidates, steps=2, warmup=1, micro=4, lr=1e-3, seed=0, model_kwargs=None):
    """Every rank: trace each candidate's `steps` steps after `warmup`; returns {candidate: counts}."""
    import shutil
    from minizero.comm import init_torch_distributed
    torch.set_num_threads(1)
    if any(not c.startswith("minizero") for c in candidates):
        init_torch_distributed(torch.device("cpu"))
    cfg = {**BENCH_GPT, **(model_kwargs or {})}
    model = build_model("tiny-gpt", seed=seed, **cfg)
    batches = [shard(b, comm.rank, comm.size) for b in global_batches(model, warmup + steps, micro * comm.size)]
    del model
    nvme_dir = tempfile.mkdtemp(prefix="minizero-bench-nvme-")
    out = {}
    try:
        for name in candidates:
            c = build(name, comm, cfg, seed, lr, micro, nvme_dir=nvme_dir)
            for x, y in batches[:warmup]:
                step(comm, c, x, y)
            calls = Counter()
            labels.collect = []
            try:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for x, y in batches[warmup:]:
                        _profiled_step(comm, c, x, y, calls)
                    c.close()  # a DPU step still in flight finishes inside the trace
                    _add_calls(comm, calls)
            finally:
                thread_ranges, labels.collect = labels.collect, None
            path = os.path.join(trace_dir, f"{name}-rank{comm.rank}.json")
            events = _write(prof, thread_ranges, path)
            counts = Counter(e["name"] for e in events if e.get("ph") == "X" and str(e.get("name")).startswith("mz."))
            out[name] = {"path": path, "labels": dict(counts), "calls": dict(calls), "overlap": overlap(events)}
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    return out


def report(per_rank, out=sys.stdout):
    for name in per_rank[0]:
        print(f"\n{name}: " + ", ".join(r[name]["path"] for r in per_rank), file=out)
        for k, r in enumerate(per_rank):
            o = r[name]["overlap"]
            hidden = o["thread_hidden_fraction"]
            print(f"  rank {k}: steps {o['step_us'] / 1e3:.1f} ms, in collectives {o['comm_us'] / 1e3:.1f} ms "
                  f"(blocked {o['blocked_us'] / 1e3:.1f} ms)" +
                  (f", other threads {o['thread_us'] / 1e3:.1f} ms of which {hidden:.0%} during backward"
                   if hidden is not None else ""), file=out)
        print("  labels (rank 0): " + ", ".join(f"{k} {v}" for k, v in sorted(per_rank[0][name]["labels"].items())),
              file=out)


def main(args) -> int:
    """The `bench --trace DIR` command (args: bench's parsed arguments)."""
    from minizero import launch
    from minizero_course.bench.common import model_for
    t0 = time.time()
    os.makedirs(args.trace, exist_ok=True)
    per_rank = launch.run("minizero_course.bench.trace:worker", nprocs=args.nprocs, timeout=args.timeout,
                          backend=args.backend,
                          args={"trace_dir": os.path.abspath(args.trace), "candidates": args.candidates,
                                "steps": args.trace_steps, "warmup": args.warmup, "micro": args.micro,
                                "model_kwargs": model_for(args.params)})
    report(per_rank)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(per_rank, f, indent=1)
    print(f"open them in https://ui.perfetto.dev ({time.time() - t0:.0f} s; 1-min load {os.getloadavg()[0]:.1f})")
    return 0


def overhead(repeats=200_000, out=sys.stdout) -> dict:
    """us per `with label(...)` with no profiler running, next to a bare record_function and a nullcontext."""
    import contextlib

    def per_call(make):
        t0 = time.perf_counter()
        for _ in range(repeats):
            with make():
                pass
        return (time.perf_counter() - t0) / repeats * 1e6
    result = {"label_us": per_call(lambda: labels.label("mz.x")),
              "record_function_us": per_call(lambda: torch.profiler.record_function("mz.x")),
              "nullcontext_us": per_call(contextlib.nullcontext)}
    print(", ".join(f"{k} {v:.2f}" for k, v in result.items()) + f" (1-min load {os.getloadavg()[0]:.1f})", file=out)
    return result


if __name__ == "__main__":
    overhead()
