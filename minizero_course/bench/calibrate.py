"""This machine's physical limits, measured: matmul FLOP/s, memory bandwidth, disk write/read bandwidth,
and the collective bandwidth of N ranks. `python -m minizero_course bench scale` divides each strategy's
step by the time these limits allow (its "bound") so that "fast" is a ratio, not a guess:

    compute_s = 6·Ψ·T / (cores · flops_per_core)      T tokens per step (all ranks); forward 2ΨT + backward 4ΨT
              + optimizer bytes / mem_bw              Adam reads p, g, m, v and writes p, m, v: 28 B per
                                                      fp32 parameter stepped (on each rank, Ψ/N or Ψ of them)
    comm_s    = bytes sent by all ranks / allreduce_bytes_per_s   (ring accounting, minizero.comm.stats)
    disk_s    = disk bytes read / disk_read_bw + written / disk_write_bw
    bound_s   = max(compute_s, comm_s, disk_s)       fraction = bound_s / measured step (1.0 = at the limit)
    MFU       = 6·Ψ·T / (step_s · cores · flops_per_core)

Each figure is one thread's (the ranks run OMP_NUM_THREADS=1) and the machine gives `cores` of them.
Disk: a file of `disk_bytes` written and fsync'ed, then its pages dropped from the page cache
(posix_fadvise DONTNEED) and read back, so the read is the disk's and not memory's.
"""
from __future__ import annotations

import os
import tempfile
import time

import torch


def matmul_flops(n=1024, repeats=5) -> float:
    """fp32 matmul FLOP/s on one thread: best of `repeats` n x n x n products (2n^3 flops each)."""
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best


def memory_bandwidth(nbytes=256 * 2 ** 20, repeats=5) -> float:
    """Bytes per second of a one-thread copy (read + write counted: 2 x nbytes per copy)."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * nbytes / best


def disk_bandwidth(folder=None, nbytes=512 * 2 ** 20) -> tuple[float, float]:
    """(write B/s including fsync, read B/s with the page cache dropped) of one file in `folder`."""
    block = os.urandom(8 * 2 ** 20)
    fd, path = tempfile.mkstemp(prefix="minizero-calibrate-", dir=folder)
    try:
        t0 = time.perf_counter()
        for _ in range(nbytes // len(block)):
            os.write(fd, block)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t0)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        while os.read(fd, len(block)):
            pass
        read = nbytes / (time.perf_counter() - t0)
        return write, read
    finally:
        os.close(fd)
        os.unlink(path)


def allreduce_worker(comm, nbytes=64 * 2 ** 20, repeats=3):
    """Ring bytes sent per second by all ranks together, in minizero.comm's all-reduce."""
    t = torch.ones(nbytes // 4)
    comm.all_reduce(t)
    best = float("inf")
    for _ in range(repeats):
        comm.stats.reset()
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(t)
        best = min(best, time.perf_counter() - t0)
    return comm.stats.sent() * comm.size / best


def calibrate(folder=None, nprocs=4, timeout=120) -> dict:
    from minizero import launch
    write, read = disk_bandwidth(folder)
    out = {"cores": os.cpu_count(), "flops_per_core": matmul_flops(), "mem_bw": memory_bandwidth(),
           "disk_write_bw": write, "disk_read_bw": read, "load_average": os.getloadavg()}
    out["allreduce_bytes_per_s"] = launch.run("minizero_course.bench.calibrate:allreduce_worker", nprocs=nprocs,
                                              timeout=timeout)[0]
    out["allreduce_ranks"] = nprocs
    return out


def bound(cal: dict, psi: int, tokens: int, ranks: int, stepped_per_rank: float, sent_bytes: float,
          disk_read: float, disk_written: float) -> dict:
    """The time this machine's limits allow one step (module docstring), each term and their max."""
    cores = min(cal["cores"], ranks)
    flops = 6 * psi * tokens
    compute = flops / (cores * cal["flops_per_core"]) + 28 * stepped_per_rank * ranks / (cores * cal["mem_bw"])
    comm = sent_bytes / cal["allreduce_bytes_per_s"]
    disk = disk_read / cal["disk_read_bw"] + disk_written / cal["disk_write_bw"]
    return {"compute_s": compute, "comm_s": comm, "disk_s": disk, "bound_s": max(compute, comm, disk),
            "model_flops": flops, "peak_flops": cores * cal["flops_per_core"]}


def report(cal: dict) -> str:
    return (f"calibration: matmul {cal['flops_per_core'] / 1e9:.1f} GFLOP/s per core x {cal['cores']} cores, "
            f"memory {cal['mem_bw'] / 1e9:.1f} GB/s (one thread), disk write {cal['disk_write_bw'] / 1e9:.2f} / "
            f"read {cal['disk_read_bw'] / 1e9:.2f} GB/s, all-reduce {cal['allreduce_bytes_per_s'] / 1e9:.2f} GB/s "
            f"sent by {cal['allreduce_ranks']} ranks together (load {cal['load_average'][0]:.1f})")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
