"""`python -m minizero_course bench scale`: the largest GPT each strategy trains on N ranks of this machine, and how
its cost grows on the way there.

The search: for each candidate, grow the size knob s (scale_probe.py: n_layer = s, n_embd = 64·s,
Ψ ≈ 49152·s³) by 4x parameters until a probe fails (memory cap, timeout, disk, error, or a loss that did not
fall), then bisect in s until the last passing and the first failing size are within --resolution in
parameters. Each probe is its own job under the cap (scale_probe.run_probe). The passing probes are the cost
curve against Ψ; --sweep-size adds one against the number of ranks at a fixed size. Per candidate a least-
squares fit of peak RSS per rank on (Ψ/N, Ψ, 1) states its growth next to the same fit of memory.estimate,
and calibrate.py's limits turn each step into a fraction of max(compute, communication, disk) and an MFU.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

from minizero.cli import checks
from minizero.launch import max_ranks
from minizero_course.bench.scale_probe import (
    CANDIDATES,
    count,
    probe_worker,  # noqa: F401  (launch targets named minizero_course.bench.scale)
    run_probe,
)


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
    """Least squares of peak RSS per rank (max rank) on (Ψ/N, Ψ, 1): bytes per sharded parameter (a), per
    replicated parameter (b), a constant (c); with one N only, Ψ/N and Ψ are the same column, so on (Ψ, 1)
    (b: bytes per parameter at that N); with one Ψ only (a ranks sweep) on (Ψ/N, 1). The same fit of the
    ledger and of memory.estimate at the same points."""
    import numpy as np
    rows = [r for r in rows if r["outcome"] == "ok" and "source" not in r]  # (rows rebuilt from a log: no ledger)
    if len({(r["psi"], r["ranks"]) for r in rows}) < 3:
        return None
    several_n, several_psi = len({r["ranks"] for r in rows}) > 1, len({r["psi"] for r in rows}) > 1
    design = np.array([[r["psi"] / r["ranks"] if several_n else 0.0, r["psi"] if several_psi else 0.0, 1.0]
                       for r in rows])  # one Ψ only: the Ψ term is inside the constant

    def coef(y):
        a, b, c = np.linalg.lstsq(design, np.array(y, dtype=float), rcond=None)[0].tolist()
        return {"a": a, "b": b, "c": c}
    return {"rss": coef([max(r["rss_peak"]) for r in rows]), "ledger": coef([_ledger_in_ram(r) for r in rows]),
            "estimate": coef([r["estimate"] for r in rows]), "points": len(rows),
            "ranks": sorted({r["ranks"] for r in rows})}


def _ledger_in_ram(row) -> float:
    """The ledger's bytes outside files (device + host) on the rank holding most: what RSS and
    memory.estimate are compared with; the disk tiers' files are not RAM."""
    return max(r["ledger"]["total"] - r["ledger"]["by_location"].get("disk", 0) for r in row["per_rank"])


def analyse(results: dict, cal: dict | None) -> dict:
    """Per candidate: the fit, and each passing probe's bound (calibrate.bound), fraction and MFU."""
    from minizero_course.bench.calibrate import bound
    for res in results["candidates"].values():
        rows = res["probes"] + results["ranks_sweep"].get(res["candidate"], [])
        res["fit"] = fit(rows)
        if res["largest"] is not None:  # (a copy after a JSON round trip: the probe itself again)
            res["largest"] = next(r for r in res["probes"] if r["size"] == res["largest"]["size"])
        for r in rows:
            if r["outcome"] == "ok" and cal and "source" not in r:  # (a row rebuilt from a log lacks the bytes)
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
        if not res["probes"]:  # (a run with the ranks sweep only)
            continue
        if r is None:
            out.append(f"{name:<27}| {'none':>8} | {res['stopped_by'][:150]}")
            continue
        nxt = f"{res['next_size'] / 1e6:.0f}M: " if res["next_size"] else ""
        out.append(f"{name:<27}| {r['psi'] / 1e6:7.0f}M | {max(r['rss_peak']) / mib:17.0f} | "
                   f"{r['disk_bytes'] / 1e9:7.2f} | {r['step_s']:7.2f} | {r['compute_s']:6.2f}/{r['comm_s']:5.2f}/"
                   f"{r['disk_s']:5.2f} | {_or_dash(r.get('fraction'), '5.2f')} | {_or_dash(r.get('mfu'), '5.3f')} | "
                   f"{nxt}{res['stopped_by'][:110]}")
    for name, res in results["candidates"].items():
        f = res.get("fit")
        if f:
            out.append(f"{name:<27} peak RSS/rank ~ {f['rss']['a']:.1f} B·Ψ/N + {f['rss']['b']:.1f} B·Ψ + "
                       f"{f['rss']['c'] / mib:.0f} MiB; ledger {f['ledger']['a']:.1f}·Ψ/N + {f['ledger']['b']:.1f}·Ψ; "
                       f"memory.estimate {f['estimate']['a']:.1f}·Ψ/N + {f['estimate']['b']:.1f}·Ψ ({f['points']} "
                       "probes, N = "
                       f"{', '.join(map(str, f['ranks']))}"
                       f"{': one N, so all of it in the Ψ term' if len(f['ranks']) == 1 else ''})")
    for why in results.get("skipped", {}).items():
        out.append(f"{why[0]:<27} skipped: {why[1]}")
    if not results.get("calibration"):
        out.append("bound and MFU: not computed (no calibration of this machine's limits: --no-calibrate or --quick)")
    return "\n".join(out)


def _or_dash(value, spec: str) -> str:
    """A figure, or a dash of the same width where it was not measured (no calibration)."""
    return format(value, spec) if value is not None else f"{'-':>{int(spec.split('.')[0])}}"


def plot(results: dict, path: str) -> dict:
    """Step time and peak RSS against Ψ (and against N where a ranks sweep ran: a run without one, such as
    --quick, draws the Ψ column only). Each candidate gets its own colour and marker, minizero's solid and the
    peers' dashed. Returns the title and what each panel shows: {"title", "panels": [{"xlabel", "ylabel",
    "series": [(label, colour, marker, line style)]}]}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    swept_any = any(r["outcome"] == "ok" for rows in results["ranks_sweep"].values() for r in rows)
    fig, axes = plt.subplots(2, 2 if swept_any else 1, figsize=(12 if swept_any else 7, 8.5), squeeze=False)
    tab20 = plt.get_cmap("tab20").colors
    colors = tab20[0::2] + tab20[1::2]  # 10 strong colours, then their light shades: 20 before one repeats
    for i, (name, res) in enumerate(results["candidates"].items()):
        swept = [r for r in results["ranks_sweep"].get(name, []) if r["outcome"] == "ok"]
        by_psi = {r["psi"]: r for r in swept if r["ranks"] == results["ranks"]}  # the sweep's N: a small Ψ point
        by_psi.update({r["psi"]: r for r in res["probes"] if r["outcome"] == "ok"})
        sweeps = (sorted(by_psi.values(), key=lambda r: r["psi"]), sorted(swept, key=lambda r: r["ranks"]))
        for col, (rows, x) in enumerate(zip(sweeps, ("psi", "ranks"))):
            if rows and col < axes.shape[1]:
                style = {"marker": "os^"[i // 10 % 3], "ms": 3, "label": name, "color": colors[i % 20],
                         "ls": "-" if name.startswith("minizero") else "--"}
                axes[0][col].plot([r[x] for r in rows], [r["step_s"] for r in rows], **style)
                axes[1][col].plot([r[x] for r in rows], [max(r["rss_peak"]) / 2 ** 20 for r in rows], **style)
    size = results.get("sweep_psi", 0) / 1e6
    for row, what in enumerate(("step time, s (slowest rank, step 3)", "peak RSS per rank, MiB (max rank)")):
        axes[row][0].set(xscale="log", yscale="log", xlabel=f"parameters Ψ ({results['ranks']} ranks)", ylabel=what)
        if swept_any:
            axes[row][1].set(xscale="log", yscale="log", xlabel=f"ranks N (Ψ = {size:.0f}M)", ylabel=what)
            axes[row][1].set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
            axes[row][1].set_xticks([], minor=True)
    for ax in axes[0]:
        if ax.lines:
            ax.legend(fontsize=7)
    title = f"bench scale: cost curves, memory cap {results['cap_bytes'] / 1e9:.1f} GB, {os.cpu_count()} cores"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    panels = [{"xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
               "series": [(line.get_label(), line.get_color(), line.get_marker(), line.get_linestyle())
                          for line in ax.lines]} for ax in axes.flat]
    plt.close(fig)
    return {"title": title, "panels": panels}


def main(argv=None) -> int:
    ap = checks.Parser(prog="minizero_course bench scale", description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES),
                    choices=list(CANDIDATES), metavar="NAME", help=f"any of: {' '.join(CANDIDATES)}")
    ap.add_argument("--ranks", type=checks.whole(1, max_ranks()), default=4, help="ranks per probe job")
    ap.add_argument("--cap-gb", type=checks.number(0, open_low=True), default=12.0,
                    help="memory cap of a probe job (RssAnon+RssShmem)")
    ap.add_argument("--cap-above-first-gb", type=checks.number(0), default=None,
                    help="instead: the first probe's job peak plus this many GB (what the ranks hold at start-up "
                         "differs between machines)")
    ap.add_argument("--timeout", type=checks.number(0, open_low=True), default=900, help="seconds per probe")
    ap.add_argument("--start", type=checks.whole(1), default=3, help="first size knob s (Ψ ~ 49152 s^3; 3: 1.3M)")
    ap.add_argument("--stop", type=checks.whole(1), default=54, help="largest s tried (54: 7.7B)")
    ap.add_argument("--resolution", type=checks.number(1, open_low=True), default=1.5,
                    help="bisect until first fail / last pass < this")
    ap.add_argument("--sweep-size", type=checks.whole(0), default=8, help="s of the ranks sweep (8: 25M); 0: no sweep")
    ap.add_argument("--sweep-ranks", type=checks.whole(1, max_ranks()), nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--folder", default=None, help="where disk probes write (default: the temp folder)")
    ap.add_argument("--disk-reserve-gb", type=checks.number(0), default=10.0, help="free space a disk probe must leave")
    ap.add_argument("--no-calibrate", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                    help="no probes: merge these runs' results (later files win per candidate), report and plot")
    ap.add_argument("--quick", action="store_true", help="the suite's version: torch-ddp and minizero-zero3-init on 2 "
                    "ranks, s 4 and 6, cap 0.2 GB above the first probe, no sweep, no calibration")
    args = ap.parse_args(argv)
    if args.stop < args.start:
        ap.error(f"--stop {args.stop} is below --start {args.start}: the search goes from --start up to --stop")
    if args.folder is not None and not os.path.isdir(args.folder):
        ap.error(f"--folder {args.folder}: no such folder (disk probes write there)")
    checks.output_file(ap, "--json", args.json)
    checks.output_file(ap, "--plot", args.plot)
    if args.quick:
        args.candidates, args.ranks, args.start, args.stop, args.resolution = \
            ["torch-ddp", "minizero-zero3-init"], 2, 4, 6, float("inf")
        # DDP needs ~0.3 GB more at s 6, ZeRO-3 ~0.1
        args.cap_above_first_gb, args.sweep_size, args.no_calibrate = args.cap_above_first_gb or 0.2, 0, True
    if args.from_json:
        try:
            results = merge(args.from_json)
        except RunFileError as e:
            ap.error(f"--from-json {e}")
        analyse(results, results["calibration"])
        print(report(results))
        if args.json:
            _write(args.json, results)
        if args.plot:
            plot(results, args.plot)
        return 0
    t0 = time.time()
    # a `kill` of this command (SIGTERM) unwinds like Ctrl-C, so that run_probe's cleanup kills the probe's job
    # and removes its folder: left to the default handler it would leave a job running that nobody watches
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from minizero_course.bench import calibrate
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
    for name, why in prebuild_deepspeed_ops(args.candidates).items():
        results["skipped"][name] = why
        args.candidates = [c for c in args.candidates if c != name]
    for name in args.candidates:
        print(f"{name}:", flush=True)
        def log(row, name=name):  # each probe's row is in the JSON as soon as it ends (an interrupted run keeps it)
            print(_line(row), flush=True)
            done = results["candidates"].get(name, {"probes": []})["probes"]
            results["candidates"][name] = {"candidate": name, "largest": None, "stopped_by": "interrupted",
                                           "next_size": None, "probes": [*done, row]}
            results["cap_bytes"] = cap["bytes"]
            if args.json:
                _write(args.json, results)
        results["candidates"][name] = search(name, args.start, args.stop, probe, args.resolution, log=log)
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


_SHM = ("DeepSpeed's shared-memory collectives op (built by init_distributed on the CPU accelerator)",
        "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder\nShareMemCommBuilder().load()")
_CPU_ADAM = ("DeepSpeedCPUAdam's op", "from deepspeed.ops.adam import DeepSpeedCPUAdam\n"
             "DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])")
_AIO = ("the async-I/O op (needs libaio-dev, an OS package)",
        "from deepspeed.ops.op_builder import AsyncIOBuilder\nAsyncIOBuilder().load()")
DEEPSPEED_OPS = {"deepspeed-z3-offload": [_CPU_ADAM], "deepspeed-z3-nvme": [_CPU_ADAM, _AIO]}  # the C++ ops each
# candidate JIT-builds beyond _SHM, which every deepspeed-* candidate builds: (what, code that builds it)


def prebuild_deepspeed_ops(candidates, timeout=1200) -> dict:
    """DeepSpeed's C++ ops, JIT-built once here (1 min for CPU Adam on an idle 2-core machine, over 15 at load
    ~18) rather than inside a probe, where the probe's timeout would kill the compiler and leave torch's build
    lock behind (every later build then waits on it forever: seen here), and where the compiler (1.5 GB) would
    count in the probe's memory, tagged through its environment. {candidate: why it cannot run}."""
    import subprocess
    why, built = {}, {}
    for name in [c for c in candidates if c.startswith("deepspeed")]:
        for what, code in [_SHM, *DEEPSPEED_OPS.get(name, [])]:
            if what not in built:
                try:
                    proc = subprocess.run([sys.executable, "-c", "import torch\n" + code], capture_output=True,
                                          text=True, timeout=timeout, check=False,
                                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
                    lines = (proc.stderr or "").strip().splitlines()
                    built[what] = (None if proc.returncode == 0
                                   else f"{what} did not build: {lines[-1] if lines else '?'}")
                except subprocess.TimeoutExpired:
                    built[what] = f"{what} did not build within {timeout} s"
            if built[what]:
                why.setdefault(name, built[what])
    return why


class RunFileError(ValueError):
    """A --from-json file that is not a run's JSON; the message names it."""


RUN_KEYS = ("candidates", "ranks_sweep", "cap_bytes", "timeout", "ranks")  # what merge and report read


def _read_run(path) -> dict:
    """One run's JSON (what --json wrote), or RunFileError saying what is wrong with the file."""
    try:
        with open(path) as f:
            res = json.load(f)
    except OSError as e:
        raise RunFileError(f"{path}: cannot read it ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunFileError(f"{path}: not valid JSON ({e})") from None
    missing = [k for k in RUN_KEYS if k not in res] if isinstance(res, dict) else list(RUN_KEYS)
    if missing or not isinstance(res["candidates"], dict):
        raise RunFileError(f"{path}: not the JSON of a `bench scale --json` run (no "
                           f"{', '.join(missing or ['candidates'])})")
    return res


def merge(paths) -> dict:
    """Several runs' JSON as one: later files win per candidate; cap and calibration from the last."""
    merged = None
    for path in paths:
        res = _read_run(path)
        if merged is None:
            merged = res
        else:
            for name, cand in res["candidates"].items():
                if name in merged["candidates"] and cand["probes"]:  # several runs of one candidate: all probes
                    cand = _combined(merged["candidates"][name]["probes"] + cand["probes"], name)
                if cand["probes"] or name not in merged["candidates"]:
                    merged["candidates"][name] = cand
            merged["ranks_sweep"].update(res.get("ranks_sweep", {}))
            merged.setdefault("skipped", {}).update(res.get("skipped", {}))
            merged["calibration"] = res.get("calibration") or merged.get("calibration")
            merged["cap_bytes"], merged["timeout"] = res["cap_bytes"], max(res["timeout"], merged["timeout"])
    return merged


def _combined(probes, name) -> dict:
    """One candidate's result from the probes of several runs: the largest that passed, the smallest that
    failed above it."""
    ok = max((r for r in probes if r["outcome"] == "ok"), key=lambda r: r["psi"], default=None)
    bad = min((r for r in probes if r["outcome"] != "ok" and (ok is None or r["psi"] > ok["psi"])),
              key=lambda r: r["psi"], default=None)
    return {"candidate": name, "largest": ok, "stopped_by": bad["outcome"] if bad else "not tried past the largest",
            "next_size": bad["psi"] if bad else None, "probes": probes}


def _write(path, results):
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    raise SystemExit(main())
