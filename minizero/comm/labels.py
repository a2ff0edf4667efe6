"""Named ranges for the profiler: what minizero is doing, visible in a torch.profiler trace
(Perfetto).

    with label("mz.all_reduce"):      # every collective, launched (and waited, when blocking)
        ...

Names used: mz.<op> for every Communicator collective (all_reduce, reduce_scatter, all_gather, ...),
mz.wait (blocking on an async handle), mz.bucket.launch (DDP / ZeRO-2 starting a bucket's
reduction), mz.fsdp.gather (ZeRO-3 starting a unit's all-gather), mz.offload.d2h / mz.offload.h2d /
mz.offload.cpu_step (ZeRO-Offload's copies and CPU step), mz.disk.read / mz.disk.write
(ZeRO-Infinity's files).

Cost. With no profiler running, a label is one check of torch's profiler flag and a nullcontext
(about 1.5 us on this CPU); torch's record_function alone costs about 30 us even then (measured in
python -m minizero_course.bench.trace --overhead), which is why it is only entered while a profiler
records.

Threads. torch's profiler records record_function on the thread that started it only; ZeRO-Offload's
DPU thread and ZeRO-Infinity's I/O pool would vanish from the trace. While `collect` is a list
(minizero_course/bench/trace.py sets it), a label on any other thread appends (name, thread id,
start, end in time.time_ns(), the clock the profiler's CPU timestamps use) to it, and the trace
driver writes those ranges into the exported trace.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time

import torch

# a list while minizero_course/bench/trace.py traces: ranges recorded on threads the profiler misses
collect = None


@contextlib.contextmanager
def _thread_range(name):
    start = time.time_ns()
    try:
        yield
    finally:
        sink = collect
        if sink is not None:
            sink.append((name, threading.get_native_id(), start, time.time_ns()))


def label(name: str):
    """A profiler range named `name` while a profiler records, else a no-op context."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    if collect is not None:
        return _thread_range(name)
    return contextlib.nullcontext()


def labelled(name: str):
    """Decorator: the whole call is a `label(name)` range."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with label(name):
                return fn(*args, **kwargs)
        return run
    return wrap
