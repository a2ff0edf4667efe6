"""`make test-gpu`: every lab's mechanism against DDP or one process, and its memory, on this machine's GPU.

    python tests/gpu/check.py [--quick] [--out PATH] [--nprocs 4] [--budget-s 480] [--only part,part]

One table (check, expected, measured, pass) of the parts in tests/gpu/parts.py, and a Markdown report with
the device, driver, torch version and date: docs/gpu.md when CUDA is present, else build/gpu.md (--out
sets it; the suite's --quick run writes to a temporary folder). Exit status 0 when every row passes.

Two launches, so the ranks start once per world size:
  * the multi-rank parts (ring all-reduce, DDP, loss scaling, ZeRO-1/2/3, offload, ZeRO++, 1F1B, TP, ring
    attention, MoE) on --nprocs ranks over the mpi backend. On one GPU every rank computes on it and the
    collectives stage through the host (comm/backends.py): NCCL refuses two ranks on one device, and gloo
    has no CUDA reduce-scatter, all-to-all or send/recv. On CPU they stage too (MINIZERO_MPI_STAGE=1), so
    the suite's run takes the GPU run's path;
  * the world-of-one parts (torch.distributed: NCCL on CUDA, gloo on CPU; fp16/bf16 matmuls; ZeRO-Offload's
    bytes each way; the quantizer) on one rank.
Bounded: each part has a timeout (a hung part is a failed row, and the parts after it run in a new launch),
and the whole run stops launching when --budget-s (8 minutes) is spent: what is left is reported as not run.
--quick runs the same parts small (the suite runs it on CPU: tests/test_gpu_check.py)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.parts import ONE, PARTS, SELFTEST, WORLD  # noqa: E402

TARGET = os.path.join(ROOT, "tests", "gpu", "parts.py") + ":run_parts"
# seconds per part: generous on 2 CPU cores (--quick), and on a GPU (ranks sharing it, collectives via the host)
TIMEOUT_S = {"quick": 120, "full": 90}
HANG_TIMEOUT_S = 10  # the self-test's hung part
STARTUP_S = 90  # starting the ranks and importing torch, per launch
ONE_RESERVE_S = 100  # of the budget, kept for the world-of-one launch


def cuda_info() -> dict:
    import torch
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "host": platform.node(), "device": "cpu", "driver": None, "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        info["device"] = torch.cuda.get_device_name(0)
        info["device_memory_GiB"] = round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30)
            info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    return info


def _failed(name: str, why: str) -> list[dict]:
    return [{"check": f"{name}: (the part)", "expected": "completes", "measured": why, "pass": False}]


def run_group(names, nprocs, backend, quick, deadline, timeouts, env=None) -> dict:
    """{part: {"rows": [...], "seconds": s}} for every name, in as few launches as the parts allow."""
    from minizero import launch
    results, pending = {}, list(names)
    while pending:
        left = deadline - time.monotonic()
        if left < 20:
            for name in pending:
                results[name] = {"rows": _failed(name, "not run: the time budget was spent"), "seconds": 0.0}
            break
        with tempfile.TemporaryDirectory(prefix="minizero-gpu-") as out_dir:
            error = None
            try:
                launch.run(TARGET, nprocs=nprocs, backend=backend, env=env, timeout=min(left, STARTUP_S + sum(
                    timeouts[n] for n in pending)), args={"names": pending, "quick": quick, "out_dir": out_dir,
                                                          "timeouts": {n: timeouts[n] for n in pending}})
            except launch.LaunchError as e:
                error = e
            for name in list(pending):
                path = os.path.join(out_dir, f"{name}.json")
                if not os.path.exists(path):
                    break
                with open(path) as f:
                    results[name] = json.load(f)
                pending.remove(name)
            if error is None or not pending:
                continue
            name = pending.pop(0)  # the part the job ended in
            note = os.path.join(out_dir, f"{name}.timeout")
            if os.path.exists(note):
                with open(note) as f:
                    why = (f"timed out after {timeouts[name]:g} s; "
                           + "; ".join(f.read().split("\n")[:nprocs]).strip("; "))
            elif isinstance(error, launch.LaunchTimeout):
                why = f"the launch ran out of time: {str(error).splitlines()[0]}"
            else:
                why = getattr(error, "last_line", None) or str(error).strip().splitlines()[0]
            results[name] = {"rows": _failed(name, why[:300]), "seconds": timeouts[name]}
    return results


def table(rows) -> str:
    widths = [max(len(h), *(len(str(r[k])) for r in rows)) if rows else len(h)
              for h, k in (("check", "check"), ("expected", "expected"), ("measured", "measured"))]
    widths = [min(w, 70) for w in widths]
    line = lambda c, e, m, p: f"{c[:widths[0]]:<{widths[0]}} | {e[:widths[1]]:<{widths[1]}} | {m:<{widths[2]}} | {p}"  # noqa: E731
    out = [line("check", "expected", "measured", "pass"), "-" * (sum(widths) + 16)]
    out += [line(r["check"], r["expected"], r["measured"], "PASS" if r["pass"] else "FAIL") for r in rows]
    return "\n".join(out)


ABOUT = """\
## What the check does

`make test-gpu` runs `tests/gpu/check.py`: for every lab's mechanism (ring all-reduce, DDP, loss scaling,
ZeRO-1/2/3, offload, ZeRO++, 1F1B, tensor parallelism, ring attention, MoE dispatch) it compares the solution's
result with DDP or with one process on the same device, and the memory each rank holds (the ledger,
`memory.measure`, and on CUDA `torch.cuda.memory_allocated` and `max_memory_allocated` of each rank) with the estimator
(`minizero/memory.py`, composed with tensor, pipeline, context and expert parallelism by `minizero/planner`).
Plus, at a world of one: torch.distributed with NCCL, fp16 and bf16 matrix products on the tensor cores
(against fp64, and against fp32's speed), ZeRO-Offload's bytes each way, and ZeRO++'s quantizer on the
device. It prints one table (check, expected, measured, pass) and writes this page with the device, the
driver, the torch version and the date. What each part compares: `tests/gpu/parts.py`.

Several ranks share the one GPU: the multi-rank parts run 4 ranks over the **mpi backend, its collectives
staged through the host** (`minizero/comm/backends.py`). NCCL refuses two ranks on one device, and gloo
has no CUDA reduce-scatter, all-to-all or send/recv. NCCL itself is checked at a world of one.

Bounded: each part has a timeout (a hung part is a failed row and the parts after it run in a fresh
launch), and the whole run stops launching after 8 minutes (`--budget-s 480`).

## What it does not check

- **Several GPUs over NCCL: never.** One GPU is lent at a time; the multi-rank parts above go through the
  mpi backend, staged through the host.
- **A user's model through `initialize` on CUDA**, with the options users set (clipping, accumulation,
  bf16): no row trains one. A user's GPT-2 small (124M, `gradient_clipping: 1.0`) on an H200 found every
  ZeRO-Offload config crashing at the clip (`all_reduce: tensor on cpu, communicator world is on cuda:0`).
  That class of bug is now caught without a GPU: `MINIZERO_STRICT_HOST=1` (minizero/host.py) makes the
  offload tiers' host tensors refuse a device collective, and `tests/test_offload.py` trains every offload
  family through it. The fix has not yet run on a GPU.
- **bf16 speed against torch's autocast.** That user measured stage 0 at 0.81-0.86x autocast's tokens/s and
  stage 3 at 0.56-0.63x at a world of one (fp32 stages 0-3: 0.97-0.98x); no change since.
- **Where `offload_param: {"device": "cpu"}` keeps ZeRO-3's shards.** FSDP makes each unit's shard on
  `comm.device` and nothing moves it, so on CUDA the shards stay on the GPU while the ledger books them as
  host memory (zero/fsdp_optimizer.py `memory_tensors`); on a CPU machine the two are the same RAM.

## How to produce it

On a machine with CUDA and this repository's environment: `make test-gpu` (it writes `docs/gpu.md`;
commit it). On a lent GPU machine with no network whose Python already has a CUDA torch: download the
mpich and mpi4py wheels into `.whl/` here as `tests/gpu/device.sh` says at its top, then run
`bash tests/gpu/device.sh $OUT` there, carrying `.whl` (about 9 minutes at most, 1-2 minutes in practice: a
preflight of torch and mpiexec, then the check), and copy the `gpu.md` it wrote over this page.

On CPU, `make test-gpu ARGS="--quick --out build/gpu.md"` runs the same parts small (about a minute on 2
cores); the suite runs it (`tests/test_gpu_check.py`), together with two parts that must fail, a ring
all-reduce one element off and a hung part, so the check cannot rot between GPU runs.
"""


def markdown(info, rows, parts, args, seconds) -> str:
    def cell(x):
        return str(x).replace("|", "\\|")
    failed = sum(not r["pass"] for r in rows)
    lines = ["# GPU check (`make test-gpu`)", "",
             f"**Run {info['date']}** on **{info['device']}**"
             + (f" ({info.get('device_memory_GiB')} GiB, driver {info['driver']}, CUDA {info['cuda']})"
                if info["cuda_available"] else " (no CUDA device: these are CPU figures)")
             + f", torch {info['torch']}, Python {info['python']}; {args.nprocs} ranks for the multi-rank parts over "
             f"the mpi backend, collectives staged through the host (NCCL refuses two ranks on one GPU), "
             f"one rank over torch.distributed ({'NCCL' if info['cuda_available'] else 'gloo'}) for the world-of-one "
             f"parts; {'--quick sizes; ' if args.quick else ''}{seconds:.0f} s in all. "
             f"**{len(rows) - failed} of {len(rows)} rows pass.**", "",
             "Produced by `make test-gpu` (`python tests/gpu/check.py`); what each part compares is in "
             "`tests/gpu/parts.py`. Every figure below was measured in that run.", "",
             "| check | expected | measured | pass |", "|---|---|---|---|"]
    lines += [f"| {cell(r['check'])} | {cell(r['expected'])} | {cell(r['measured'])} | "
              f"{'yes' if r['pass'] else '**no**'} |"
              for r in rows]
    lines += ["", "Seconds per part: " + ", ".join(f"{n} {p['seconds']:.0f}" for n, p in parts.items()) + ".", "",
              ABOUT]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/gpu/check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the same parts, small (the CPU suite's smoke run)")
    ap.add_argument("--out", help="where the Markdown report goes (default: docs/gpu.md with CUDA, else build/gpu.md)")
    ap.add_argument("--selftest", action="store_true",
                    help="first run two parts that must fail (a wrong ring all-reduce, a hung one): the check's own "
                    "test")
    ap.add_argument("--json", help="also write the rows and the machine as JSON here")
    ap.add_argument("--nprocs", type=int, default=4, help="ranks of the multi-rank parts (default 4; at least 2)")
    ap.add_argument("--budget-s", type=float, default=480, help="stop launching after this many seconds (default 480)")
    ap.add_argument("--only", help=f"comma-separated parts, in order: {', '.join(PARTS)}")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else [*WORLD, *ONE]
    if args.selftest:  # a wrong result, then a hang: both must be failed rows, and the parts after them still run
        names = [*SELFTEST, *[n for n in names if n not in SELFTEST]]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"--only: unknown part(s) {', '.join(unknown)}; the parts are: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if args.nprocs < 2 or args.nprocs % 2:
        print(f"--nprocs must be an even number >= 2 (ZeRO++'s nodes and MoE's ep are 2 ranks), got {args.nprocs}",
              file=sys.stderr)
        return 2
    info = cuda_info()
    if not info["cuda_available"] and not args.quick:  # a GPU's sizes on 2 cores: fp16 matmuls alone take minutes
        print("no CUDA device: running the --quick sizes on the CPU", file=sys.stderr)
        args.quick = True
    out = args.out or os.path.join(ROOT, "docs" if info["cuda_available"] else "build", "gpu.md")
    info["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    timeouts = {n: HANG_TIMEOUT_S if n == "selftest_hang" else TIMEOUT_S["quick" if args.quick else "full"]
                for n in names}
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    parts = {}
    world = [n for n in names if n not in ONE]
    one = [n for n in names if n in ONE]
    if world:  # leaves the world-of-one parts (NCCL, tensor cores) their share of the budget
        # MINIZERO_MPI_STAGE: on CPU too, every collective takes the host-staging path CUDA tensors take
        parts.update(run_group(world, args.nprocs, "mpi", args.quick, deadline - (ONE_RESERVE_S if one else 0),
                               timeouts,
                               env={"MINIZERO_MPI_STAGE": "1"}))
    if one:
        parts.update(run_group(one, 1, "torch", args.quick, deadline, timeouts))
    rows = [r for n in names for r in parts[n]["rows"]]
    seconds = time.monotonic() - t0
    print(f"\n{info['device']}, torch {info['torch']}, {args.nprocs} ranks + 1; {seconds:.0f} s\n")
    print(table(rows))
    print("\nseconds per part: " + ", ".join(f"{n} {parts[n]['seconds']:.0f}" for n in names))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(markdown(info, rows, {n: parts[n] for n in names}, args, seconds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows, "seconds": seconds, "parts": {n: parts[n] for n in names}}, f,
                      indent=1)
    failed = sum(not r["pass"] for r in rows)
    print(f"\n{len(rows) - failed}/{len(rows)} rows pass; wrote {out}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
