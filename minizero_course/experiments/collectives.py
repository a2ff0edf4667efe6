"""minizero_course.experiments.collectives: measure collectives and fit the alpha-beta ring model (lesson 01).

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
    """The table nccl-tests prints, from the best time t of the repeats (the time the lesson's
    prose and fits use; the median is printed beside it):
      algbw = S / t: how fast YOUR tensor got reduced;
      busbw = bytes a rank sent / t (from comm.stats; 2(N-1)/N * S for all-reduce): what the
              links carried, comparable across N and ops and with a ping-pong's bandwidth."""
    lib = "MPI" if result["backend"] == "mpi" else "NCCL" if result.get("device") == "cuda" else "gloo"
    lines = [f"{op} on {result['N']} rank{'s' * (result['N'] != 1)}, {lib} (algbw and busbw from the best time)",
             f"{'size':>9} {'median us':>10} {'best us':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in result["rows"]:
        if r["op"] == op and (sizes is None or r["size"] in sizes):
            lines.append(f"{size_label(r['size']):>9} {r['time'] * 1e6:10.1f} {r['best'] * 1e6:9.1f} "
                         f"{r['size'] / r['best'] / 1e9:11.2f} {r['sent'] / r['best'] / 1e9:11.2f}")
    return "\n".join(lines)


def size_label(nbytes: float) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


# ----------------------------------------------------------------------------- what the run says
# A GPU cluster's alpha and beta, for comparison with the fits on this machine.
# alpha: NCCL 2.30's own cost model (src/graph/tuning.cc, ncclTunerConstantsDefaults): a fixed
# base latency per call plus a hardware latency per ring step, by protocol (LL .. Simple).
# beta: the links' datasheet rates, one direction: NVLink 4 on an H100 SXM, 900 GB/s total
# (450 GB/s each way); an InfiniBand NDR port (ConnectX-7), 400 Gb/s = 50 GB/s.
GPU_LINKS = {
    "NVLink 4 (H100, one node)": {"step_us": (0.6, 3.4), "call_us": (6.6, 14.0), "GBps": 450.0},
    "InfiniBand NDR (between nodes)": {"step_us": (2.7, 14.0), "call_us": (6.6, 14.0), "GBps": 50.0},
}
FIT_TOLERANCE = 0.25  # a size where the model is within 25% of the measured time counts as fitted


def _sizes(sizes) -> str:
    return ", ".join(size_label(s) for s in sizes) if len(sizes) else "none"


def _off(error: float) -> str:
    """'37% above' / '12% below' / '4.2× the time of': a measurement against a model, from error = model / measured -
    1."""
    ratio = 1 / (1 + error)
    if ratio >= 2:
        return f"{ratio:.1f}× the time of"
    return f"{abs(ratio - 1):.0%} {'above' if ratio > 1 else 'below'}"


def findings(res, gloo, pp_alpha, pp_beta, load, cores) -> dict:
    """The figures lesson 01's conclusions are drawn from, as plain numbers (seconds, GB/s, ratios):
    res = {2: time_collectives on 2 ranks, 4: on 4 ranks}, gloo = time_collectives on 2 gloo ranks."""
    ops = tuple(STEPS)

    def best(result, op):
        return {r["size"]: r["best"] for r in result["rows"] if r["op"] == op}

    b = {(N, op): best(res[N], op) for N in res for op in ops}
    sizes = sorted(b[2, "all_reduce"])
    fit = {N: fit_alpha_beta(sorted(b[N, "all_reduce"]), [b[N, "all_reduce"][s] for s in sorted(b[N, "all_reduce"])],
                             op="all_reduce", N=N) for N in res}
    a2, b2 = fit[2]
    err = {op: {s: ring_time(op, s, 2, a2, b2) / b[2, op][s] - 1 for s in sizes} for op in ops}
    large = [s for s in sizes if s >= 2**16]
    big, small = sizes[-1], sizes[0]
    bus = {N: max(r["sent"] / r["best"] for r in res[N]["rows"] if r["op"] == "all_reduce") / 1e9 for N in res}
    g = best(gloo, "all_reduce")
    return {
        "load": max(load), "cores": cores,
        "pp_alpha": pp_alpha, "pp_GBps": 1 / pp_beta / 1e9,
        "fit_alpha": {N: a for N, (a, _) in fit.items()}, "fit_GBps": {N: 1 / bb / 1e9 for N, (_, bb) in fit.items()},
        "bus_GBps": bus,
        "small": small, "small_times": {op: b[2, op][small] for op in ops},
        "half": {op: float(np.median([b[2, op][s] / b[2, "all_reduce"][s] for s in large])) for op in ops[1:]},
        "fit_error": {op: float(np.median([abs(e) for e in err[op].values()])) for op in ops},
        "all_reduce_error": err["all_reduce"],  # signed, per size: model / measured - 1
        "big": big, "n_ratio": b[4, "all_reduce"][big] / b[2, "all_reduce"][big],
        "n_pred": ring_time("all_reduce", big, 4, a2, b2) / ring_time("all_reduce", big, 2, a2, b2),
        "spread": {N: float(np.median([r["time"] / r["best"] for r in res[N]["rows"]])) for N in res},
        "gloo_vs_mpi": {s: (b[2, "all_reduce"][s], g[s]) for s in sorted(g) if s in b[2, "all_reduce"]},
        "gloo_rs_vs_ar": best(gloo, "reduce_scatter")[big] / g[big],
    }


def describe(f: dict) -> str:
    """Lesson 01's conclusions as Markdown, one sentence for each side of every comparison."""
    def us(t):
        return f"{t * 1e6:.0f} µs"
    out = ["All comparisons below use the best of 10 repeats, as the bandwidth tables do."]
    if f["load"] > 0.5 * f["cores"]:
        out.append(f"**The machine was busy while measuring** (load average up to {f['load']:.1f} on {f['cores']} "
                   "cores): other programs competed with our ranks, so the medians are inflated, and even the best "
                   "times may be.")
    else:
        out.append(f"The machine was quiet while measuring (load average at most {f['load']:.1f} on {f['cores']} "
                   "cores).")

    # ping-pong vs collective bandwidth: one extra pass over memory (the addition) explains at most about 2x
    pp, bus2 = f["pp_GBps"], f["bus_GBps"][2]
    r = pp / bus2
    s = (f"* **Ping-pong vs collectives (2 ranks).** The ping-pong gave α = {f['pp_alpha'] * 1e6:.1f} µs and {pp:.1f} "
         f"GB/s; the ring fit on all-reduce gives α = {f['fit_alpha'][2] * 1e6:.1f} µs per step and "
         f"{f['fit_GBps'][2]:.1f} GB/s, and the best all-reduce busbw on 2 ranks was {bus2:.1f} GB/s. ")
    if r < 0.8:
        s += (f"The collective's busbw beat the ping-pong's bandwidth ({1 / r:.1f}×), so neither figure is the "
              "memory's limit here: both are the fastest of a few repeats, and on a shared machine a few repeats may "
              "all be slowed.")
    elif r <= 1.25:
        s += "The two are close: copying the bytes, not adding them, limits the collective here."
    elif r <= 2.2:
        s += (f"The collective was {r:.1f}× slower than the ping-pong, which the reduction can explain: adding the "
              "received chunk into its own is one more pass over memory, and at shared-memory speeds it costs about as "
              "much as the copy.")
    else:
        s += (f"The collective was {r:.1f}× slower than the ping-pong: more than the reduction explains (one more pass "
              "over memory costs at most about 2×). The rest is what the α-β model leaves out: every ring step waits "
              "for the other rank, and a rank that is not running at that moment (other programs, the scheduler) "
              "delays both.")
    out.append(s)

    # small messages: the ring model's 2 : 1 : 1, and whether one alpha describes all three ops
    t = f["small_times"]
    spread = max(t.values()) / min(t.values())
    s = (f"* **Small messages.** At {size_label(f['small'])} on 2 ranks, all-reduce took {us(t['all_reduce'])}, "
         f"reduce-scatter {us(t['reduce_scatter'])} and all-gather {us(t['all_gather'])}, against the ring model's 2 : "
         "1 : 1. For small messages MPI libraries do not run a ring: they switch to latency-optimised algorithms "
         "(recursive doubling, or flag-based shared-memory schemes within one node). ")
    if spread <= 2:
        s += f"Here the three ops are within {spread:.1f}× of each other: none pays for a ring's many steps. "
    else:
        slow, fast = max(t, key=t.get), min(t, key=t.get)
        s += (f"Here they differ by {spread:.1f}× ({slow.replace('_', '-')} the slowest, {fast.replace('_', '-')} the "
              "fastest): no single α describes all three, since each op and size gets its own algorithm, and at a few "
              "µs per message one scheduling delay shows. ")
    per_message = [x / f["pp_alpha"] for x in t.values()]
    lo, hi = min(per_message), max(per_message)
    if hi <= 2 and lo >= 0.5:
        s += f"Each cost about one ping-pong message (α = {us(f['pp_alpha'])}): one round of messages."
    elif hi < 0.5:
        s += (f"Each cost less than one ping-pong message's α ({us(f['pp_alpha'])}): the ping-pong ran at another "
              "moment of a shared machine, and its α is not the collectives' here.")
    elif lo > 2:
        s += (f"They cost {lo:.1f}-{hi:.1f} ping-pong messages (α = {us(f['pp_alpha'])}), "
              "not one round.")
    else:
        s += (f"They cost {lo:.1f}-{hi:.1f} ping-pong messages (α = {us(f['pp_alpha'])}): "
              + ("some less than one, which no algorithm allows, so the ping-pong's α was "
                 "measured at another moment of a shared machine" if lo < 0.5 else
                 "the cheapest about one round")
              + (", and some several rounds' worth." if hi > 2 else
                 ", none more than two rounds' worth."))
    out.append(s)

    # where the alpha-beta ring model fits and where it does not (2 ranks, fitted on all-reduce)
    e = f["all_reduce_error"]
    fits = [x for x in sorted(e) if abs(e[x]) <= FIT_TOLERANCE]
    misses = [x for x in sorted(e) if abs(e[x]) > FIT_TOLERANCE]
    worst = max(e, key=lambda x: abs(e[x]))
    s = (f"* **Where the α-β model fits (2 ranks).** Fitted on the all-reduce, the ring model is within "
         f"{FIT_TOLERANCE:.0%} of the measured all-reduce at {_sizes(fits)}, and off by more at {_sizes(misses)} "
         f"(worst at {size_label(worst)}, where the measurement was {_off(e[worst])} the model). Its median error is "
         f"{f['fit_error']['all_reduce']:.0%} on the all-reduce it was fitted on, and "
         f"{f['fit_error']['reduce_scatter']:.0%} on reduce-scatter and {f['fit_error']['all_gather']:.0%} on "
         "all-gather (predicted). ")
    fe = f["fit_error"]
    if max(fe.values()) <= FIT_TOLERANCE:
        s += "So on this machine two numbers, α and β, are a fair first estimate of a collective's time."
    elif fe["all_reduce"] <= FIT_TOLERANCE:
        s += ("So α and β describe the all-reduce they were fitted on, but do not predict the other two ops on this "
              f"machine (more than {FIT_TOLERANCE:.0%} off): the library runs each op its own way.")
    else:
        s += ("So on this machine α and β are not the cost: the model misses by more than "
              f"{FIT_TOLERANCE:.0%} even on the data it was fitted on. What it leaves out here is the library "
              "switching algorithms by size and ranks waiting for a core.")
    out.append(s)
    s = ("* **Large messages (≥ 64 KiB).** The model says reduce-scatter and all-gather each take 0.5× the all-reduce "
         "time. Measured (the median over those sizes): ")
    parts = []
    for op in ("reduce_scatter", "all_gather"):
        h = f["half"][op]
        verdict = ("close to the model" if abs(h - 0.5) <= 0.15
                   else ("more than the model" if h > 0.5 else "less than the model"))
        parts.append(f"{h:.2f}× for {op.replace('_', '-')} ({verdict})")
    s += "; ".join(parts) + "."
    if f["half"]["reduce_scatter"] > 0.65:
        s += (" A reduce-scatter also adds what it receives, and MPICH runs its own algorithm for it: a model that "
              "counts only messages and bytes sees neither.")
    out.append(s)

    # 2 -> 4 ranks
    nr, npred, b4 = f["n_ratio"], f["n_pred"], f["bus_GBps"][4]
    s = (f"* **2 → 4 ranks.** At {size_label(f['big'])} the 2-rank model predicts that 4 ranks take {npred:.2f}× as "
         f"long (the bandwidth term grows like $2(N-1)/N$, from 1 to 1.5). Measured: {nr:.2f}×. ")
    if nr > 1.25 * npred:
        s += ("That is more than the model: the cost of oversubscription, 4 ranks on "
              f"{f['cores']} cores waiting for the scheduler rather than for the copy.")
    elif nr < 0.8 * npred:
        s += (f"That is less than the model, which no link model can explain: the 2-rank time at this size was "
              f"{_off(f['all_reduce_error'][f['big']])} its own fit, so the noise of single measurements, not the "
              "ring, sets this ratio.")
    else:
        s += "That is within 25% of the model, even with oversubscribed ranks."
    s += f" The best 4-rank busbw was {b4:.2f} GB/s against {bus2:.2f} GB/s on 2 ranks: "
    if b4 > 1.2 * bus2:
        s += ("higher, which the model does not allow (busbw is what each link carries, the same at any N): the 2-rank "
              "run was slowed by something other than its bytes.")
    elif b4 < bus2 / 1.2:
        s += "lower, as two ranks sharing each core predicts."
    else:
        s += "about the same, as the model says."
    s += (f" The 4-rank fit gives α = {f['fit_alpha'][4] * 1e6:.0f} µs per step against {f['fit_alpha'][2] * 1e6:.1f} "
          f"µs, and a typical call took {f['spread'][4]:.2f}× its best repeat on 4 ranks against {f['spread'][2]:.2f}× "
          "on 2.")
    out.append(s)

    # gloo vs MPI, size by size
    gm = f["gloo_vs_mpi"]
    mpi_wins = [x for x in gm if gm[x][0] < gm[x][1]]
    gloo_wins = [x for x in gm if gm[x][0] >= gm[x][1]]
    s = f"* **gloo vs MPI (all-reduce, 2 ranks).** MPI was faster at {_sizes(mpi_wins)}; gloo at {_sizes(gloo_wins)}. "
    if not gloo_wins:
        s += "This run supports minizero's choice of MPI for CPU collectives at every size measured."
    elif not mpi_wins:
        s += ("In this run gloo was faster at every size: the speed argument for minizero's MPI default did not hold "
              "here.")
    else:
        s += (f"So the faster backend depends on the message size in this run: MPI won at {len(mpi_wins)} of {len(gm)} "
              f"sizes, gloo at {len(gloo_wins)}; minizero's MPI default is the faster choice only where MPI won.")
    g = f["gloo_rs_vs_ar"]
    s += f" gloo's reduce-scatter took {g:.1f}× as long as its own all-reduce at {size_label(f['big'])}: "
    s += ("it has no native reduce-scatter on CPU and emulates it, so it is slower than the all-reduce that contains "
          "it."
          if g > 1 else "no slower than the all-reduce that contains it, although gloo emulates reduce-scatter on CPU.")
    out.append(s)
    return "\n".join(out)


def gpu_comparison(alpha_s: float, GBps: float) -> str:
    """A table: this machine's fitted alpha and bandwidth against a GPU cluster's (GPU_LINKS), with n_1/2."""
    rows = ["| link | α per ring step | + per call | bandwidth one way | n½ = α/β |", "|---|---|---|---|---|",
            f"| this machine, fitted (2 ranks) | {alpha_s * 1e6:.1f} µs | (in α) | {GBps:.1f} GB/s | "
            f"{alpha_s * GBps * 1e9 / 2**10:.0f} KiB |"]
    for name, link in GPU_LINKS.items():
        lo, hi = link["step_us"]
        n_half = [x * 1e-6 * link["GBps"] * 1e9 / 2**10 for x in (lo, hi)]
        rows.append(f"| {name} | {lo:g}-{hi:g} µs | {link['call_us'][0]:g}-{link['call_us'][1]:g} µs | "
                    f"{link['GBps']:g} GB/s | {n_half[0]:.0f}-{n_half[1]:.0f} KiB |")
    nv = GPU_LINKS["NVLink 4 (H100, one node)"]
    rows.append(f"\nNVLink carries {nv['GBps'] / GBps:.0f}× the bandwidth fitted here, at "
                f"{alpha_s * 1e6 / nv['step_us'][1]:.0f}-{alpha_s * 1e6 / nv['step_us'][0]:.0f}× less latency per ring "
                "step. Where n½ is larger than here, more messages are latency-bound: NCCL answers with its "
                "low-latency protocols (LL, LL128) and tree algorithms for small and medium messages, and DDP with "
                "buckets far above n½ (torch's 25 MiB).")
    return "\n".join(rows)
