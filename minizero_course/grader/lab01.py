"""Lab 01 checks: a ring all-reduce from send/recv equals MPI's Allreduce for N = 1..4 (sub-groups of
one 4-rank job), waits for every send, and sends 2(N-1)/N*S bytes."""
import time

import torch

from minizero_course.grader import Check, CheckFailed, Lab
from minizero.comm import ring_bytes_sent

LAB = Lab(1, "ring_allreduce", "Ring all-reduce from send/recv", "minizero/comm/ring.py")

SIZES = (1, 5, 12, 1001, 4099)  # odd sizes: chunks of unequal length


def _data(rank, n, dtype):
    g = torch.Generator().manual_seed(7 + 31 * rank + n)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _compare(group, ring, timed):
    """On every rank of `group`: the student's ring vs group.all_reduce on the same data."""
    worst = []
    for n in SIZES:
        for dtype in (torch.float32, torch.float64):
            mine, ref = (_data(group.rank, n, dtype).to(group.device) for _ in range(2))
            timed.records.clear()
            out = ring(timed, mine)
            if timed.in_flight():  # a handle never waited: its buffer may still be in use
                return {"never_waited": [r["op"] for r in timed.in_flight()], "size": n, "dtype": str(dtype)}
            group.all_reduce(ref)
            if out is not None and out.data_ptr() != mine.data_ptr():
                mine = out
            diff = (mine - ref).abs().max().item()
            tol = 1e-5 if dtype == torch.float32 else 1e-12  # the summation order differs from MPI's
            bound = tol * max(1.0, ref.abs().max().item())
            # which of the ring's N chunks came out right: names the phase that went wrong
            pairs = zip(torch.tensor_split(mine.view(-1), group.size), torch.tensor_split(ref.view(-1), group.size))
            chunks = [bool(((a - b).abs() <= bound).all()) for a, b in pairs]
            worst.append((diff, n, str(dtype), diff <= bound, chunks))
    return worst


def equals_allreduce_worker(comm, impl, sizes=(3, 2, 4, 1)):
    """For each N in `sizes`: ranks 0..N-1 of this one job form a sub-communicator (a real N-rank
    MPI communicator) and compare the student's ring with its all_reduce; one launch, not four.
    N=3 first: uneven chunks, and a ring where a wrong direction or step shows (at N=2 it cannot).
    The ring talks through a TimedComm, which notes whether every isend/irecv handle was waited."""
    from minizero_course.experiments.timed_comm import TimedComm
    from minizero.launch import load_target
    ring = load_target(impl + ":ring_all_reduce")
    out = {}
    for n in sizes:
        group = comm.split(0 if comm.rank < n else 1, name=f"n{n}")
        if comm.rank < n:
            out[str(n)] = _compare(group, ring, TimedComm(group, lambda: 0))
    return out


def bytes_worker(comm, impl, n=1 << 16):
    from minizero.launch import load_target
    ring = load_target(impl + ":ring_all_reduce")
    t = torch.ones(n)
    comm.stats.reset()
    t0 = time.perf_counter()
    ring(comm, t)
    return {"sent": comm.stats.sent(), "all_reduce_calls": comm.stats.ops["all_reduce"].calls
            if "all_reduce" in comm.stats.ops else 0, "ok": bool(torch.all(t == comm.size)),
            "seconds": time.perf_counter() - t0}


def check_equals_allreduce(impl):
    from minizero import launch
    res = launch.run("minizero_course.grader.lab01:equals_allreduce_worker", nprocs=4, args={"impl": impl}, timeout=90)
    lines = []
    for n in res[0]:
        for rank, per_n in enumerate(res[:int(n)]):
            worst = per_n[n]
            if isinstance(worst, dict):
                raise CheckFailed(f"N={n}: rank {rank} returned from ring_all_reduce (size {worst['size']}, "
                                  f"{worst['dtype']}) with {len(worst['never_waited'])} {worst['never_waited'][0]}(s) "
                                  "never waited for: wait() on every isend handle before its chunk changes, "
                                  "and before returning")
            for diff, size, dtype, ok, _ in worst:
                if not ok:
                    own = (rank + 1) % int(n)  # the chunk this rank holds whole after phase 1
                    # the chunk pattern of a failing size whose N chunks are all non-empty says which phase failed
                    chunks = next((c for _, s, _, good, c in worst if not good and s >= int(n)), [True] * int(n))
                    why = ""
                    if int(n) > 2 and chunks[own] and not any(c for i, c in enumerate(chunks) if i != own):
                        why = (f": only chunk {own}, the one this rank finished summing in phase 1, is right. The "
                               "chunks that arrive in phase 2 are complete sums already: receive each INTO its "
                               "chunk (overwrite), do not add it to the partial sum this rank holds")
                    elif not chunks[own]:
                        why = (f": chunk {own}, the one this rank holds whole after phase 1, is already wrong: look "
                               "at phase 1 (which chunk is sent and received at step s, and that the received one is "
                               "added)")
                    raise CheckFailed(f"N={n}: rank {rank} result differs from MPI Allreduce for size {size} "
                                      f"{dtype} (max diff {diff:.3g}){why}")
        lines.append(f"N={n}: max diff {max(d for r in res[:int(n)] for d, *_ in r[n]):.2e} over sizes {SIZES}")
    return "\n".join(sorted(lines))


def check_bytes(impl):
    from minizero import launch
    n, N = 1 << 16, 4
    res = launch.run("minizero_course.grader.lab01:bytes_worker", nprocs=N, args={"impl": impl, "n": n}, timeout=60)
    want = ring_bytes_sent("all_reduce", n * 4, N)
    for rank, r in enumerate(res):
        if r["all_reduce_calls"]:
            raise CheckFailed(f"rank {rank} called comm.all_reduce: build the ring from isend/recv only")
        if not r["ok"]:
            raise CheckFailed(f"rank {rank}: wrong result for a tensor of ones (expected all {N})")
        if abs(r["sent"] - want) > 1e-9 * want:
            raise CheckFailed(f"rank {rank} sent {r['sent']:.0f} bytes, the ring sends 2(N-1)/N*S = {want:.0f}")
    return f"N={N}, S={n * 4} B: every rank sent {want:.0f} B = 2(N-1)/N*S"


CHECKS = [
    Check("equals MPI Allreduce for N=1..4 and odd sizes", 6, check_equals_allreduce),
    Check("bytes sent per rank = 2(N-1)/N*S", 4, check_bytes),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab01_ring_allreduce.py` shows."""
    n = 1 << 20
    t = _data(comm.rank, n, torch.float32)
    ref = t.clone()
    comm.all_reduce(ref)
    comm.stats.reset()
    t0 = time.perf_counter()
    impl.ring_all_reduce(comm, t)
    dt = time.perf_counter() - t0
    sent = comm.stats.sent()
    diffs = comm.allgather_object((t - ref).abs().max().item())
    sents = comm.allgather_object(sent)
    if comm.rank == 0:
        print(f"ring all-reduce of {n * 4 / 1e6:.1f} MB on {comm.size} ranks ({comm.backend}): {dt * 1e3:.1f} ms")
        print(f"max |ring - MPI Allreduce| per rank: {['%.1e' % d for d in diffs]}")
        print(f"bytes sent per rank: {[int(s) for s in sents]}  (2(N-1)/N*S = "
              f"{ring_bytes_sent('all_reduce', n * 4, comm.size):.0f})")
