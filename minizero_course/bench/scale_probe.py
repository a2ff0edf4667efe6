"""One probe of `python -m minizero_course bench scale` (scale.py): a GPT of size s trained 3 steps on N ranks as its
own job, under a memory cap, and what it measured.

Size rule, one knob s:  n_layer = s, n_embd = 64·s, n_head = s (head width 64), vocab 64, sequence 32,
    Ψ ≈ 12·s·(64 s)² = 49152·s³  (s = 3: 1.4M ... s = 34: 1.93B, s = 35: 2.11B, s = 43: 3.91B; exact counts from a meta
    build).
Training: micro-batch 1, the same batch each step, torch Adam, fp32, lr 1e-4/s (Adam moves every weight by
about lr: the step shrinks with the width, as in muP; measured: at a fixed 1e-3 the loss of a 108M model rose
again at step 3 (4.34, 4.02, 5.11), and at 1e-3/s so did an 865M one (4.52, 4.24, 5.30), the depth adding
up the updates too); a probe passes when the global loss of step 3 is below step 1's.

Never takes the machine down: each probe is its own job (launch.run: mpirun in a new session) whose
processes carry a tag in their environment; a watcher sums the anonymous + shared RSS (RssAnon + RssShmem:
what cannot be dropped; mapped files' pages can) of every tagged process every 0.2 s and SIGKILLs them all
when the sum passes --cap-gb (its sampled peak is reported), or when the machine's MemAvailable falls below
1.5 GB (the machine is shared: others' growth counts too). A disk probe first checks that the free space
minus its need (16 B per parameter: fp32 master, m, v and the parameters' file) keeps --disk-reserve-gb free.
Each probe has a timeout (launch.run kills the job), and its temporary folder is removed however it ends.
minizero's watchdog is raised to the probe's timeout (its default, 300 s, is a few steps at 2B parameters);
collectives keep torch's own timeout (comm/backends.py bounds only the rendezvous by MINIZERO_INIT_TIMEOUT_S).

Per probe, on each rank: peak RSS (VmHWM, whole process, reset before the build), the ledger (memory.measure
of what the rank holds, read after the last backward), bytes sent, disk bytes (the files in its folder, and
the tier's read/written counters) and the step split: comm_s = time the main thread waited in collectives
(minizero.comm ops and torch.distributed calls made from Python; torch DDP's C++ reducer is not seen),
disk_s = time the disk tier's reads and writes took (on its I/O threads: overlapped or not), and
compute_s = step - comm_s (includes the optimizer and any disk wait that was not hidden).
calibrate.py turns Ψ, tokens, bytes into the time this machine's limits allow: fraction and MFU.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid

CANDIDATES = {  # scale name -> (bench candidate, build as its docs say for large models)
    "torch-ddp": ("torch-ddp", False), "torch-fsdp2": ("torch-fsdp2", True),
    "minizero-zero3": ("minizero-zero3", False), "minizero-zero3-init": ("minizero-zero3-init", True),
    "minizero-zero3-offload": ("minizero-zero3-offload", True), "minizero-zero3-nvme": ("minizero-zero3-nvme", True),
    "minizero-zero3-nvme-params": ("minizero-zero3-nvme-params", True),
    "deepspeed-z3": ("deepspeed-z3", False), "deepspeed-z3-init": ("deepspeed-z3", True),
    "deepspeed-z3-offload": ("deepspeed-z3-offload", True), "deepspeed-z3-nvme": ("deepspeed-z3-nvme", True)}
DISK = ("minizero-zero3-nvme", "minizero-zero3-nvme-params", "deepspeed-z3-nvme")
ESTIMATE = {"torch-ddp": 0, "torch-fsdp2": 3, "deepspeed-z3": 3, "deepspeed-z3-init": 3,
            # ZeRO stage for memory.estimate; minizero-* by name below
            "deepspeed-z3-offload": 3, "deepspeed-z3-nvme": 3}


def gpt(size: int) -> dict:
    return {"vocab_size": 64, "block_size": 32, "n_layer": size, "n_head": size, "n_embd": 64 * size}


def count(size: int) -> int:
    import torch

    from minizero.models import build_model
    with torch.device("meta"):
        return sum(p.numel() for p in build_model("tiny-gpt", **gpt(size)).parameters())


def estimated_bytes(candidate: str, psi: int, ranks: int) -> float:
    """memory.estimate for fp32 Adam (4-byte params and grads, 8 bytes of state): what stays in RAM here
    (this machine's device is its host, so device + host); the disk tiers' bytes are not RAM."""
    from minizero import memory
    stage = 3 if candidate.startswith("minizero") else ESTIMATE[candidate]
    e = memory.Estimate(memory.estimate_by_location(psi, ranks, stage, 4, 4, 8, "nvme" if candidate in DISK else
                                                    "cpu" if "offload" in candidate else "none",
                                                    "nvme" if candidate.endswith("nvme-params") else "none"))
    return e.device + e.host


# ----------------------------------------------------------------------------- on every rank of a probe
class _Timers:
    """Seconds the main thread waited in collectives, and the disk tier's I/O seconds (any thread)."""

    def __init__(self):
        self.comm_s = self.disk_s = 0.0
        self._lock, self._depth = threading.Lock(), threading.local()

    def wrap(self, owner, name, kind):
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            main = threading.current_thread() is threading.main_thread()
            outer = kind == "disk" or (main and getattr(self._depth, "n", 0) == 0)
            self._depth.n = getattr(self._depth, "n", 0) + 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n -= 1
                if outer:
                    with self._lock:
                        setattr(self, kind + "_s", getattr(self, kind + "_s") + time.perf_counter() - t0)
        setattr(owner, name, timed)

    def install(self):
        import torch.distributed as dist

        from minizero_course.bench.candidates import _COUNTED
        from minizero.comm.backends import Work
        from minizero.comm.communicator import Communicator
        from minizero.zero.infinity import DiskOptimizer
        self.wrap(Communicator, "_run", "comm")
        self.wrap(Work, "wait", "comm")
        for name in _COUNTED:
            if getattr(dist, name, None) is not None:
                self.wrap(dist, name, "comm")
        self.wrap(DiskOptimizer, "_read", "disk")
        self.wrap(DiskOptimizer, "_write_file", "disk")


def _du(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if os.path.exists(os.path.join(d, f)))


def probe_worker(comm, candidate, size, steps=3, micro=1, lr=None, folder=None, seed=0):
    import types

    import torch

    from minizero import memory
    from minizero_course.bench.common import fixed_mmap_threshold, reset_hwm, status_kb
    from minizero_course.bench.candidates import (
        TORCH_STATS,
        build,
        count_torch_collectives,
        start_deepspeed,
    )
    from minizero_course.bench.common import barrier
    from minizero.comm import init_torch_distributed
    from minizero.data import shard
    from minizero_course.experiments.references import global_batches
    fixed_mmap_threshold()
    torch.set_num_threads(1)
    init_torch_distributed(torch.device("cpu"))
    count_torch_collectives()
    if candidate.startswith("deepspeed"):
        why = start_deepspeed(comm)
        if why:
            raise RuntimeError(f"DeepSpeed did not start: {why}")
    timers = _Timers()
    timers.install()
    cfg, lr = gpt(size), lr or 1e-4 / size
    x, y = shard(global_batches(types.SimpleNamespace(**cfg), 1, micro * comm.size, seed=seed)[0], comm.rank, comm.size)
    mine = os.path.join(folder, f"rank{comm.rank}")
    os.makedirs(mine, exist_ok=True)
    name, meta = CANDIDATES[candidate]
    rss0, _ = status_kb("VmRSS") * 1024, reset_hwm()
    t0 = time.perf_counter()
    c = build(name, comm, cfg, seed, lr, micro, count_ddp=True, meta_init=meta, nvme_dir=mine, sized_to_model=True)
    build_s, rows, ledger = time.perf_counter() - t0, [], None
    engine = getattr(c.ledger, "__self__", None)
    traffic = getattr(getattr(engine, "offload", None), "traffic", None)
    for k in range(steps):
        comm.stats.reset()
        TORCH_STATS.reset()
        timers.comm_s = timers.disk_s = 0.0
        disk0 = (traffic.disk_read, traffic.disk_written) if traffic else (0, 0)
        barrier(comm)
        t0 = time.perf_counter()
        loss = c.backward(x, y)
        if k == steps - 1:  # gradients and optimizer state alive: the ledger, outside the timing
            pause = time.perf_counter()
            ledger = (c.ledger() if c.ledger is not None else memory.measure(*c.held())).as_dict()
            t0 += time.perf_counter() - pause
        c.update()
        step_s = time.perf_counter() - t0
        stats = comm.stats if c.bytes_source == "minizero.comm" else TORCH_STATS
        rows.append({"step_s": step_s, "loss": float(loss.detach()), "comm_s": timers.comm_s,
                     "disk_s": timers.disk_s, "compute_s": step_s - timers.comm_s, "sent": stats.sent(),
                     "disk_read": (traffic.disk_read - disk0[0]) if traffic else 0,
                     "disk_written": (traffic.disk_written - disk0[1]) if traffic else 0})
    out = {"rank": comm.rank, "build_s": build_s, "steps": rows, "ledger": ledger, "disk_bytes": _du(mine),
           "rss_before": rss0, "rss_peak": status_kb("VmHWM") * 1024, "load": os.getloadavg()}
    c.close()
    out["losses"] = [sum(v) / comm.size for v in zip(*comm.allgather_object([r["loss"] for r in rows]))]
    return out


# ----------------------------------------------------------------------------- one probe, from outside
def _tagged(tag: str) -> list[int]:
    marker = f"MINIZERO_SCALE_PROBE={tag}".encode()
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{d}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    pids.append(int(d))
    return pids


def _unshared_rss(pid: int) -> int:
    """RssAnon + RssShmem of a process, bytes (0 if it is gone)."""
    total = 0
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
    return total


def _available() -> float:
    """The kernel's MemAvailable, bytes: what the whole machine (other users included) can still get."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def run_probe(candidate, size, ranks=4, cap_bytes=12e9, timeout=900, folder=None, disk_reserve=10e9, steps=3,
              min_available=1.5e9):
    """One probe as its own job under the memory cap. Returns a row: outcome ('ok' or why not) and figures."""
    from minizero import launch
    psi = count(size)
    row = {"candidate": candidate, "size": size, "psi": psi, "ranks": ranks, "cap_bytes": cap_bytes,
           "load_before": os.getloadavg()}
    folder = folder or tempfile.gettempdir()
    if candidate in DISK:
        need, free = 16 * psi * 1.1, shutil.disk_usage(folder).free
        if free - need < disk_reserve:
            return {**row, "outcome": f"disk: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free, "
                                      f"{disk_reserve / 1e9:.0f} GB kept for others"}
    tmp, tag, result = tempfile.mkdtemp(prefix="minizero-scale-", dir=folder), uuid.uuid4().hex, {}

    def job():
        try:
            result["ranks"] = launch.run("minizero_course.bench.scale_probe:probe_worker", nprocs=ranks,
                                         timeout=timeout,
                                         args={"candidate": candidate, "size": size, "folder": tmp, "steps": steps},
                                         # cold ranks: the cap watches the job's own processes, found
                                         # by this tag in their /proc environ (a fork's is its zygote's)
                                         env={"MINIZERO_SCALE_PROBE": tag, "MINIZERO_WATCHDOG_S": str(timeout),
                                              "MINIZERO_ZYGOTE": "0"})
        except Exception as e:  # noqa: BLE001  classified below
            result["error"] = e
    t0, peak, peak_pid, capped = time.time(), 0, {}, False
    th = threading.Thread(target=job, daemon=True)
    th.start()
    try:
        while th.is_alive():
            pids = _tagged(tag)
            rss = {p: _unshared_rss(p) for p in pids}
            peak = max(peak, sum(rss.values()))
            for p, v in rss.items():
                peak_pid[p] = max(peak_pid.get(p, 0), v)
            low = _available() < min_available
            if (sum(rss.values()) > cap_bytes or low) and not capped:
                capped = (f"the machine's MemAvailable fell below {min_available / 1e9:.1f} GB" if low
                          else f"the job's RssAnon+RssShmem passed {cap_bytes / 1e9:.1f} GB")
                for p in pids:
                    with contextlib.suppress(OSError):
                        os.kill(p, signal.SIGKILL)
            th.join(0.2)
    finally:
        for p in _tagged(tag):
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
    row.update(wall_s=time.time() - t0, job_peak_unshared=peak, load_after=os.getloadavg(),
               peak_unshared_per_process=sorted(peak_pid.values(), reverse=True)[:ranks])
    err = result.get("error")
    if capped:
        return {**row, "outcome": f"memory cap: {capped}"}
    if err is not None:
        kind = "timeout" if type(err).__name__ == "LaunchTimeout" else \
            "disk" if "DiskError" in str(err) or "No space" in str(err) else "error"
        return {**row, "outcome": f"{kind}: {type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    per_rank = result["ranks"]
    losses = per_rank[0]["losses"]
    last = [r["steps"][-1] for r in per_rank]
    row.update(losses=losses, per_rank=per_rank, rss_peak=[r["rss_peak"] for r in per_rank],
               ledger=[r["ledger"]["total"] for r in per_rank], disk_bytes=sum(r["disk_bytes"] for r in per_rank),
               step_s=max(s["step_s"] for s in last), comm_s=max(s["comm_s"] for s in last),
               disk_s=max(s["disk_s"] for s in last), compute_s=max(s["compute_s"] for s in last),
               sent=sum(s["sent"] for s in last), disk_read=sum(s["disk_read"] for s in last),
               disk_written=sum(s["disk_written"] for s in last), estimate=estimated_bytes(candidate, psi, ranks))
    ok = losses[-1] < losses[0]
    return {**row, "outcome": "ok" if ok else f"loss did not decrease: {losses}"}
