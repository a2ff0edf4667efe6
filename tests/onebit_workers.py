"""Ranks of tests/test_onebit.py: everything it asserts, measured in one job."""
import time

from minizero_course.experiments import onebit


def main(comm, steps=150):
    t0 = time.perf_counter()
    out = {"warmup": onebit.warmup_equals_adam(comm), "warmup_wd": onebit.warmup_equals_adam(comm, weight_decay=0.1),
           "bytes": {kind: onebit.phase_bytes(comm, per_tensor=kind == "per_tensor")
                     for kind in ("per_tensor", "flat")},
           "feedback": onebit.feedback_average(comm, numel=1001)}
    out["convergence"] = onebit.convergence(comm, steps=steps)
    out["seconds"] = time.perf_counter() - t0
    return out
