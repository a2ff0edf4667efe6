"""`python -m minizero bench scale`: the largest GPT each strategy trains on N ranks of this machine, and how
its cost grows on the way there (issue 26 items 1-3).

Size rule, one knob s:  n_layer = s, n_embd = 64·s, n_head = s (head width 64), vocab 64, sequence 32,
    Ψ ≈ 12·s·(64 s)² = 49152·s³  (s = 3: 1.3M ... s = 34: 2.0B, s = 43: 3.9B; exact counts from a meta build).
A probe trains s for 3 steps on N ranks (micro-batch 1, the same batch each step, torch Adam, fp32, lr 1e-3/s:
Adam moves every weight by about lr, so the step shrinks as 1/width as in muP; at a fixed 1e-3 the loss of a
108M model rose again at step 3, measured) and passes when the global loss of step 3 is below step 1's. The search grows s by 4x parameters until a
probe fails, then bisects (in s) until the gap is below --resolution in parameters.

Never takes the machine down: each probe is its own job (launch.run: mpirun in a new session) whose
processes carry a tag in their environment; a watcher sums the anonymous + shared RSS (RssAnon + RssShmem:
what cannot be dropped; mapped files' pages can) of every tagged process every 0.2 s and SIGKILLs them all
when the sum passes --cap-gb (its sampled peak is reported), or when the machine's MemAvailable falls below
1.5 GB (the machine is shared: others' growth counts too). A disk probe first checks that the free space
minus its need (16 B per parameter: fp32 master, m, v and the parameters' file) keeps --disk-reserve-gb free.
Each probe has a timeout (launch.run kills the job), and its temporary folder is removed however it ends.
The gloo process group's timeout and minizero's watchdog are raised to the probe's timeout (gloo's default
here is MINIZERO_INIT_TIMEOUT_S = 60 s, shorter than one step at 1B+ parameters).

Per probe, on each rank: peak RSS (VmHWM, whole process, reset before the build), the ledger (memory.measure
of what the rank holds, read after the last backward), bytes sent, disk bytes (the files in its folder, and
the tier's read/written counters) and the step split: comm_s = time the main thread waited in collectives
(minizero.comm ops and torch.distributed calls made from Python; torch DDP's C++ reducer is not seen),
disk_s = time the disk tier's reads and writes took (on its I/O threads: overlapped or not), and
compute_s = step - comm_s (includes the optimizer and any disk wait that was not hidden).
calibrate.py turns Ψ, tokens, bytes into the time this machine's limits allow: fraction and MFU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
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
    "deepspeed-z3-offload": ("deepspeed-z3-offload", True)}
DISK = ("minizero-zero3-nvme", "minizero-zero3-nvme-params")
ESTIMATE = {"torch-ddp": 0, "torch-fsdp2": 3, "deepspeed-z3": 3, "deepspeed-z3-init": 3,
            "deepspeed-z3-offload": 3}  # ZeRO stage for memory.estimate; minizero-* by name below


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

        from minizero.bench.candidates import _COUNTED
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
    from minizero.bench.bench import _fixed_mmap_threshold, _reset_hwm, _status_kb
    from minizero.bench.candidates import (
        TORCH_STATS,
        build,
        count_torch_collectives,
        start_deepspeed,
    )
    from minizero.bench.common import barrier
    from minizero.comm import init_torch_distributed
    from minizero.data import shard
    from minizero.experiments.references import global_batches
    _fixed_mmap_threshold()
    torch.set_num_threads(1)
    init_torch_distributed(torch.device("cpu"))
    count_torch_collectives()
    if candidate.startswith("deepspeed"):
        why = start_deepspeed(comm)
        if why:
            raise RuntimeError(f"DeepSpeed did not start: {why}")
    timers = _Timers()
    timers.install()
    cfg, lr = gpt(size), lr or 1e-3 / size
    x, y = shard(global_batches(types.SimpleNamespace(**cfg), 1, micro * comm.size, seed=seed)[0], comm.rank, comm.size)
    mine = os.path.join(folder, f"rank{comm.rank}")
    os.makedirs(mine, exist_ok=True)
    name, meta = CANDIDATES[candidate]
    rss0, _ = _status_kb("VmRSS") * 1024, _reset_hwm()
    t0 = time.perf_counter()
    c = build(name, comm, cfg, seed, lr, micro, count_ddp=True, meta_init=meta, nvme_dir=mine)
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
           "rss_before": rss0, "rss_peak": _status_kb("VmHWM") * 1024, "load": os.getloadavg()}
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
            result["ranks"] = launch.run("minizero.bench.scale:probe_worker", nprocs=ranks, timeout=timeout,
                                         args={"candidate": candidate, "size": size, "folder": tmp, "steps": steps},
                                         env={"MINIZERO_SCALE_PROBE": tag, "MINIZERO_INIT_TIMEOUT_S": str(timeout),
                                              "MINIZERO_WATCHDOG_S": str(timeout)})
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
                capped = "the machine's MemAvailable fell below " \
                    f"{min_available / 1e9:.1f} GB" if low else f"the job's RssAnon+RssShmem passed {cap_bytes / 1e9:.1f} GB"
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


# ----------------------------------------------------------------------------- the search and the sweeps
def grow(size: int) -> int:
    """The next size to try: about 4x the parameters (s x 4^(1/3))."""
    return max(size + 1, round(size * 4 ** (1 / 3)))


def search(candidate, start, stop, probe, resolution=1.5, log=None) -> dict:
    """Grow from `start` by grow() until a probe fails (or `stop`), then bisect in s until the last passing
    and the first failing size are within `resolution` in parameters. probe(candidate, size) -> row."""
    rows, ok, bad = [], None, None
    size, log = start, log or (lambda row: print(_line(row), flush=True))
    while size <= stop:
        rows.append(probe(candidate, size))
        log(rows[-1])
        if rows[-1]["outcome"] != "ok":
            bad = rows[-1]
            break
        ok = rows[-1]
        size = grow(size)
    while ok is not None and bad is not None and bad["size"] - ok["size"] > 1 and bad["psi"] / ok["psi"] > resolution:
        rows.append(probe(candidate, round((ok["size"] * bad["size"]) ** 0.5)))
        log(rows[-1])
        ok, bad = (rows[-1], bad) if rows[-1]["outcome"] == "ok" else (ok, rows[-1])
    return {"candidate": candidate, "largest": ok, "stopped_by": bad["outcome"] if bad else f"not tried past s={stop}",
            "next_size": bad["psi"] if bad else None, "probes": rows}


def _line(r) -> str:
    head = f"  {r['candidate']:<27} s={r['size']:<3} {r['psi'] / 1e6:9.1f}M  N={r['ranks']}"
    if r["outcome"] != "ok":
        return f"{head}  {r['outcome'][:160]}"
    return (f"{head}  step {r['step_s']:.2f}s (comm {r['comm_s']:.2f}, disk {r['disk_s']:.2f})  peak RSS/rank "
            f"{max(r['rss_peak']) / 2 ** 20:.0f} MiB  job {r['job_peak_unshared'] / 1e9:.2f} GB  disk "
            f"{r['disk_bytes'] / 1e9:.2f} GB  ({r['wall_s']:.0f} s, load {r['load_before'][0]:.1f})")


def fit(rows) -> dict | None:
    """Least squares of peak RSS per rank (max rank) on Ψ/N, Ψ and 1: bytes per sharded parameter (a), per
    replicated parameter (b), constant (c); the same fit of memory.estimate's bytes at the same points."""
    import numpy as np
    rows = [r for r in rows if r["outcome"] == "ok"]
    if len({(r["psi"], r["ranks"]) for r in rows}) < 3:
        return None
    design = np.array([[r["psi"] / r["ranks"], r["psi"], 1.0] for r in rows])
    coef = lambda y: np.linalg.lstsq(design, np.array(y, dtype=float), rcond=None)[0].tolist()
    a, b, c = coef([max(r["rss_peak"]) for r in rows])
    la, lb, lc = coef([max(r["ledger"]) for r in rows])
    ea, eb, ec = coef([r["estimate"] for r in rows])
    return {"rss": {"a": a, "b": b, "c": c}, "ledger": {"a": la, "b": lb, "c": lc},
            "estimate": {"a": ea, "b": eb, "c": ec}, "points": len(rows)}


def analyse(results: dict, cal: dict | None) -> dict:
    """Per candidate: the fit, and each passing probe's bound (calibrate.bound), fraction and MFU."""
    from minizero.bench.calibrate import bound
    for res in results["candidates"].values():
        rows = res["probes"] + results["ranks_sweep"].get(res["candidate"], [])
        res["fit"] = fit(rows)
        for r in rows:
            if r["outcome"] == "ok" and cal:
                stepped = r["psi"] / (1 if res["candidate"] == "torch-ddp" else r["ranks"])
                b = bound(cal, r["psi"], 32 * r["ranks"], r["ranks"], stepped, r["sent"], r["disk_read"],
                          r["disk_written"])
                r.update(bound=b, fraction=b["bound_s"] / r["step_s"], mfu=b["model_flops"] / (r["step_s"] *
                                                                                                 b["peak_flops"]))
    return results


# ----------------------------------------------------------------------------- report, plot, command
def report(results: dict) -> str:
    mib = 2 ** 20
    out = [(f"largest GPT trained 3 steps with the loss decreasing, {results['ranks']} ranks, memory cap "
           f"{results['cap_bytes'] / 1e9:.1f} GB (RssAnon+RssShmem of the whole job), probe timeout "
           f"{results['timeout']:.0f} s, size rule n_layer=s, n_embd=64s"),
           (f"{'candidate':<27}| {'largest':>8} | {'peak RSS/rank MiB':>17} | {'disk GB':>7} | {'step s':>7} | "
           f"{'compute/comm/disk s':>19} | {'bound':>5} | {'MFU':>5} | stopped the next size")]
    for name, res in results["candidates"].items():
        r = res["largest"]
        if r is None:
            out.append(f"{name:<27}| {'none':>8} | {res['stopped_by'][:150]}")
            continue
        nxt = f"{res['next_size'] / 1e6:.0f}M: " if res["next_size"] else ""
        out.append(f"{name:<27}| {r['psi'] / 1e6:7.0f}M | {max(r['rss_peak']) / mib:17.0f} | "
                   f"{r['disk_bytes'] / 1e9:7.2f} | {r['step_s']:7.2f} | {r['compute_s']:6.2f}/{r['comm_s']:5.2f}/"
                   f"{r['disk_s']:5.2f} | {r.get('fraction', float('nan')):5.2f} | {r.get('mfu', float('nan')):5.3f} | "
                   f"{nxt}{res['stopped_by'][:110]}")
    for name, res in results["candidates"].items():
        f = res.get("fit")
        if f:
            out.append(f"{name:<27} peak RSS/rank ~ {f['rss']['a']:.1f} B·Ψ/N + {f['rss']['b']:.1f} B·Ψ + "
                       f"{f['rss']['c'] / mib:.0f} MiB; ledger {f['ledger']['a']:.1f}·Ψ/N + {f['ledger']['b']:.1f}·Ψ; "
                       f"memory.estimate {f['estimate']['a']:.1f}·Ψ/N + {f['estimate']['b']:.1f}·Ψ ({f['points']} probes)")
    for why in results.get("skipped", {}).items():
        out.append(f"{why[0]:<27} skipped: {why[1]}")
    return "\n".join(out)


def plot(results: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for name, res in results["candidates"].items():
        sweeps = (sorted((r for r in res["probes"] if r["outcome"] == "ok"), key=lambda r: r["psi"]),
                  sorted((r for r in results["ranks_sweep"].get(name, []) if r["outcome"] == "ok"),
                         key=lambda r: r["ranks"]))
        for col, (rows, x) in enumerate(zip(sweeps, ("psi", "ranks"))):
            if rows:
                style = {"marker": "o", "ms": 3, "label": name, "ls": "-" if name.startswith("minizero") else "--"}
                axes[0][col].plot([r[x] for r in rows], [r["step_s"] for r in rows], **style)
                axes[1][col].plot([r[x] for r in rows], [max(r["rss_peak"]) / 2 ** 20 for r in rows], **style)
    size = results.get("sweep_psi", 0) / 1e6
    for row, what in enumerate(("step time, s (slowest rank, step 3)", "peak RSS per rank, MiB (max rank)")):
        axes[row][0].set(xscale="log", yscale="log", xlabel=f"parameters Ψ ({results['ranks']} ranks)", ylabel=what)
        axes[row][1].set(xscale="log", yscale="log", xlabel=f"ranks N (Ψ = {size:.0f}M)", ylabel=what)
        axes[row][1].set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"bench scale: cost curves, cap {results['cap_bytes'] / 1e9:.0f} GB, {os.cpu_count()} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="minizero bench scale", description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES),
                    choices=list(CANDIDATES), metavar="NAME", help=f"any of: {' '.join(CANDIDATES)}")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--cap-gb", type=float, default=12.0, help="memory cap of a probe job (RssAnon+RssShmem)")
    ap.add_argument("--cap-above-first-gb", type=float, default=None,
                    help="instead: the first probe's job peak plus this many GB (what the ranks hold at start-up "
                         "differs between machines)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per probe")
    ap.add_argument("--start", type=int, default=3, help="first size knob s (Ψ ~ 49152 s^3; 3: 1.3M)")
    ap.add_argument("--stop", type=int, default=54, help="largest s tried (54: 7.7B)")
    ap.add_argument("--resolution", type=float, default=1.5, help="bisect until first fail / last pass < this")
    ap.add_argument("--sweep-size", type=int, default=8, help="s of the ranks sweep (8: 25M); 0: no sweep")
    ap.add_argument("--sweep-ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--folder", default=None, help="where disk probes write (default: the temp folder)")
    ap.add_argument("--disk-reserve-gb", type=float, default=10.0, help="free space a disk probe must leave")
    ap.add_argument("--no-calibrate", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                    help="no probes: merge these runs' results (later files win per candidate), report and plot")
    ap.add_argument("--quick", action="store_true", help="the suite's version: torch-ddp and minizero-zero3-init on 2 "
                    "ranks, s 4 and 6, cap 0.3 GB above the first probe, no sweep, no calibration")
    args = ap.parse_args(argv)
    if args.quick:
        args.candidates, args.ranks, args.start, args.stop, args.resolution = \
            ["torch-ddp", "minizero-zero3-init"], 2, 4, 6, float("inf")
        args.cap_above_first_gb, args.sweep_size, args.no_calibrate = args.cap_above_first_gb or 0.3, 0, True
    if args.from_json:
        results = merge(args.from_json)
        analyse(results, results["calibration"])
        print(report(results))
        if args.json:
            _write(args.json, results)
        if args.plot:
            plot(results, args.plot)
        return 0
    t0 = time.time()
    from minizero.bench import calibrate
    cal = None if args.no_calibrate else calibrate.calibrate(args.folder, nprocs=args.ranks)
    if cal:
        print(calibrate.report(cal), flush=True)
    cap = {"bytes": args.cap_gb * 1e9}

    def probe(candidate, size, ranks=args.ranks):
        row = run_probe(candidate, size, ranks, cap["bytes"], args.timeout, args.folder, args.disk_reserve_gb * 1e9)
        if args.cap_above_first_gb is not None and "first" not in cap:
            cap["first"] = row.get("job_peak_unshared", 0)
            cap["bytes"] = cap["first"] + args.cap_above_first_gb * 1e9
        return row
    results = {"ranks": args.ranks, "timeout": args.timeout, "calibration": cal, "candidates": {}, "ranks_sweep": {},
               "load_before": os.getloadavg(), "argv": argv, "skipped": {}}
    if "deepspeed-z3-offload" in args.candidates:
        why = prebuild_cpu_adam()
        if why:
            results["skipped"]["deepspeed-z3-offload"] = why
            args.candidates = [c for c in args.candidates if c != "deepspeed-z3-offload"]
    for name in args.candidates:
        print(f"{name}:", flush=True)
        results["candidates"][name] = search(name, args.start, args.stop, probe, args.resolution)
        results["cap_bytes"] = cap["bytes"]
        if args.json:  # what finished so far survives an interrupted run
            _write(args.json, results)
    if args.sweep_size:
        results["sweep_psi"] = count(args.sweep_size)
        for name in args.candidates:
            print(f"{name}, ranks sweep at s={args.sweep_size}:", flush=True)
            results["ranks_sweep"][name] = [probe(name, args.sweep_size, n) for n in args.sweep_ranks]
            for r in results["ranks_sweep"][name]:
                print(_line(r), flush=True)
    results["cap_bytes"], results["load_after"], results["wall_s"] = cap["bytes"], os.getloadavg(), time.time() - t0
    analyse(results, cal)
    print(report(results))
    if args.json:
        _write(args.json, results)
    if args.plot:
        plot(results, args.plot)
    print(f"({results['wall_s']:.0f} s)")
    return 0


def prebuild_cpu_adam(timeout=1200) -> str | None:
    """DeepSpeedCPUAdam's C++ op, JIT-built once here (minutes on 2 cores) rather than inside a probe, where
    the probe's timeout would kill the compiler and leave torch's build lock behind (every later build then
    waits on it forever: seen here). None, or why it cannot be built."""
    import subprocess
    import sys
    code = ("import torch\nfrom deepspeed.ops.adam import DeepSpeedCPUAdam\n"
            "DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              check=False, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    except subprocess.TimeoutExpired:
        return f"DeepSpeedCPUAdam's op did not build within {timeout} s"
    lines = (proc.stderr or "").strip().splitlines()
    return None if proc.returncode == 0 else f"DeepSpeedCPUAdam's op did not build: {lines[-1] if lines else '?'}"


def merge(paths) -> dict:
    """Several runs' JSON as one: later files win per candidate; cap and calibration from the last."""
    merged = None
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        if merged is None:
            merged = res
        else:
            merged["candidates"].update(res["candidates"])
            merged["ranks_sweep"].update(res.get("ranks_sweep", {}))
            merged.setdefault("skipped", {}).update(res.get("skipped", {}))
            merged["calibration"] = res.get("calibration") or merged.get("calibration")
            merged["cap_bytes"], merged["timeout"] = res["cap_bytes"], max(res["timeout"], merged["timeout"])
    return merged


def _write(path, results):
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    raise SystemExit(main())
