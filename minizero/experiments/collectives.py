"""minizero.experiments.collectives: measure collectives and fit the alpha-beta ring model (lesson 01).

The alpha-beta model: one message of m bytes costs  alpha + m*beta  (alpha: latency per
message, beta: seconds per byte = 1/bandwidth). A ring collective over N ranks on a payload
of S bytes is N-1 steps (reduce-scatter, all-gather) or 2(N-1) steps (all-reduce: the two in
a row), each step sending one S/N chunk to the next rank (Patarasuk & Yuan 2009; Thakur,
Rabenseifner & Gropp 2005):
    all_reduce       T = 2(N-1) * (alpha + S/N * beta)
    reduce_scatter   T =  (N-1) * (alpha + S/N * beta)      S = the full input
    all_gather       T =  (N-1) * (alpha + S/N * beta)      S = the full output
The bandwidth term tends to 2*S*beta as N grows: a ring all-reduce costs each rank about the
same on 8 or 8000 GPUs. Only the latency term grows with N.

The workers (`whoami`, `pingpong`, `time_collectives`, `decompose_all_reduce`) run on every
rank through `minizero.launch.run`; the rest are plain functions for the notebook.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # ring passes of N-1 steps


def ring_time(op: str, S: float, N: int, alpha: float, beta: float) -> float:
    """Seconds for `op` on S bytes over N ranks under the alpha-beta ring model (see above)."""
    return STEPS[op] * (N - 1) * (alpha + S / N * beta)


def fit_alpha_beta(sizes, times, op: str | None = None, N: int | None = None):
    """Least-squares fit of t = alpha + S*beta; returns (alpha seconds, beta seconds/byte).

    With `op` and `N` it fits the ring model instead, t = STEPS*(N-1) * (alpha + S/N*beta), so
    alpha and beta are per ring step and comparable with a ping-pong's.
    It minimises the RELATIVE error (each row divided by its time): sizes span 1 KB..8 MB and a
    plain fit would let the largest messages decide everything, leaving alpha as noise."""
    S, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    k, s = (STEPS[op] * (N - 1), S / N) if op else (1.0, S)
    A = np.stack([np.full_like(s, k), k * s], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


# ----------------------------------------------------------------------------- workers
def whoami(comm):
    """What one rank knows about itself: each rank is a separate process with its own pid."""
    return {"rank": comm.rank, "size": comm.size, "pid": os.getpid(), "backend": comm.backend}


def _slowest(comm, times):
    """A collective ends when its last rank does: per repeat take the slowest rank's time.
    Returns (median, min) over repeats. allgather_object is metadata, not in comm.stats."""
    slowest = [max(ts) for ts in zip(*comm.allgather_object(times))]
    return statistics.median(slowest), min(slowest)


def _timed(comm, f, repeats, warmup):
    times = []
    for i in range(warmup + repeats):
        comm.barrier()  # start together: time this op, not the stragglers of the previous one
        t0 = time.perf_counter()
        f()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return _slowest(comm, times)


def time_collectives(comm, sizes_bytes=(2**10, 2**14, 2**18, 2**20, 2**22),
                     ops=("all_reduce", "reduce_scatter", "all_gather"), repeats=10, warmup=2):
    """Time each op on fp32 payloads of about S bytes (S rounded down to a multiple of 4N).
    Rows: {op, size (payload bytes), time (median s), best (min s), sent}, where `sent` is
    what this rank sends per call under the ring model, read from comm.stats."""
    rows, N = [], comm.size
    for op in ops:
        for S in sizes_bytes:
            n = max(1, S // (4 * N))
            big, small = torch.ones(n * N), torch.ones(n)
            f = {"all_reduce": lambda: comm.all_reduce(big),
                 "reduce_scatter": lambda: comm.reduce_scatter(small, big),
                 "all_gather": lambda: comm.all_gather(big, small)}[op]
            comm.stats.reset()
            med, best = _timed(comm, f, repeats, warmup)
            st = comm.stats.ops[op]
            rows.append({"op": op, "size": st.payload_bytes // st.calls, "time": med, "best": best,
                         "sent": st.sent_bytes / st.calls})
    return {"N": N, "backend": comm.backend, "device": comm.device.type, "rows": rows}


def pingpong(comm, sizes_bytes=(8, 2**10, 2**14, 2**18, 2**20, 2**22), repeats=30):
    """Rank 0 sends S bytes to rank 1, which sends them back; one-way time = round trip / 2.
    Other ranks only join the barriers. Rows: {size, time (median s), best (min s), bandwidth
    (size / median time), sent}."""
    rows = []
    for S in sizes_bytes:
        buf = torch.zeros(max(1, S // 4))

        def trip():
            if comm.rank == 0:
                comm.send(buf, 1)
                comm.recv(buf, 1)
            elif comm.rank == 1:
                comm.recv(buf, 0)
                comm.send(buf, 0)
        comm.stats.reset()
        med, best = (x / 2 for x in _timed(comm, trip, repeats, warmup=2))
        rows.append({"size": buf.numel() * 4, "time": med, "best": best, "bandwidth": buf.numel() * 4 / med,
                     "sent": comm.stats.sent("send") / (repeats + 2)})
    return {"rank": comm.rank, "rows": rows}


def decompose_all_reduce(comm, n=1000, repeats=3):
    """all_reduce(x) == all_gather(reduce_scatter(x)), run on the same integer-valued data.

    Integer values make fp32 sums exact in any order, so the two paths must agree bitwise.
    Returns the max abs difference, the bytes this rank sent on each path (from comm.stats)
    and the median time of each path."""
    N, k = comm.size, -(-n // comm.size)  # pad to a multiple of N, as ZeRO does
    x = torch.zeros(k * N)
    x[:n] = torch.randint(-100, 100, (n,), generator=torch.Generator().manual_seed(comm.rank)).float()

    def one_shot():
        y = x.clone()
        comm.all_reduce(y)
        return y

    def two_step():
        shard, y = torch.empty(k), torch.empty(k * N)
        comm.reduce_scatter(shard, x)  # rank r ends with the sum of chunk r ...
        comm.all_gather(y, shard)      # ... then every rank collects every summed chunk
        return y

    out, res = {}, {"N": N, "payload": k * N * 4}
    for name, f in (("all_reduce", one_shot), ("rs_ag", two_step)):
        comm.stats.reset()
        out[name] = f()
        res["sent_" + name] = comm.stats.sent()
        res["time_" + name] = _timed(comm, f, repeats, warmup=1)[0]
    res["max_abs_diff"] = float((out["all_reduce"] - out["rs_ag"]).abs().max())
    return res


# ----------------------------------------------------------------------------- reporting
def bandwidth_table(result, op="all_reduce", sizes=None) -> str:
    """The table nccl-tests prints, from the median time t:
      algbw = S / t: how fast YOUR tensor got reduced;
      busbw = bytes a rank sent / t (from comm.stats; 2(N-1)/N * S for all-reduce): what the
              links carried, comparable across N and ops and with a ping-pong's bandwidth."""
    lib = "MPI" if result["backend"] == "mpi" else "NCCL" if result.get("device") == "cuda" else "gloo"
    lines = [f"{op} on {result['N']} rank{'s' * (result['N'] != 1)}, {lib}",
             f"{'size':>9} {'median us':>10} {'best us':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in result["rows"]:
        if r["op"] == op and (sizes is None or r["size"] in sizes):
            size = f"{r['size'] / 2**20:g} MiB" if r["size"] >= 2**20 else f"{r['size'] / 2**10:g} KiB"
            lines.append(f"{size:>9} {r['time'] * 1e6:10.1f} {r['best'] * 1e6:9.1f} "
                         f"{r['size'] / r['time'] / 1e9:11.2f} {r['sent'] / r['time'] / 1e9:11.2f}")
    return "\n".join(lines)
