"""`python -m minizero.launcher` (console script `minizero-deepspeed`): DeepSpeed's `deepspeed`
command on one machine, with its flags (deepspeed/launcher/runner.py), for the scripts written for
it.

    python -m minizero.launcher --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json

starts 2 ranks of `train.py --deepspeed --deepspeed_config ds.json --local_rank=K`, each with
DeepSpeed's per-rank environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
launcher/rank.py), under mpirun (minizero's default on CPU: its MPI backend) or
`--launcher torchrun` (torch.distributed: gloo on CPU, NCCL on CUDA; `python -m minizero torchrun`,
which leaves no log folder behind). The exit code is the job's.

How many ranks, as DeepSpeed counts them on one node: --num_gpus N (alias --num_accelerators); else
--include localhost:0,2 (those devices) or --exclude localhost:1 (all but those); else every GPU
torch sees, or one rank on a machine without one. On CUDA the chosen devices become
CUDA_VISIBLE_DEVICES, as DeepSpeed sets it. Several nodes (--num_nodes > 1, a hostfile or --include
naming another host) are refused with the command to use instead: minizero's multi-node runs start
mpirun or torchrun on each node (docs/nodes.md). DeepSpeed's flags that only matter there
(--launcher pdsh/openmpi/..., --launcher_args, --ssh_port, --no_ssh_check, --force_multi,
--node_rank, elastic training, autotuning, core binding) are refused when set.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

LOCAL_HOSTS = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
LAUNCHERS = ("mpirun", "torchrun")
# DeepSpeed's MPI launchers: one machine's mpirun here
MPI_NAMES = ("openmpi", "mpich", "impi", "mvapich")


def parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: the script's own flags (--a,
    # --num_gpus) after user_script stay the script's
    p = argparse.ArgumentParser(prog="python -m minizero.launcher", allow_abbrev=False,
                                description="DeepSpeed's launcher on one machine "
                                            "(minizero.launcher)")
    p.add_argument("-H", "--hostfile", default=None,
                   help="DeepSpeed's hostfile ('host slots=N' lines); one host only (minizero runs "
                        "one node here)")
    p.add_argument("-i", "--include", default="",
                   help="devices to use, DeepSpeed's form: localhost:0,1")
    p.add_argument("-e", "--exclude", default="",
                   help="devices not to use, DeepSpeed's form: localhost:1")
    p.add_argument("--num_nodes", type=int, default=-1,
                   help="1 (several nodes: start mpirun/torchrun per node)")
    p.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
                   help="ranks on this machine (default: every GPU torch sees, or 1 without one)")
    p.add_argument("--master_port", type=int, default=None,
                   help="torch.distributed's rendezvous port (default: a free one, said on stderr)")
    p.add_argument("--master_addr", default="",
                   help="torch.distributed's rendezvous address (default 127.0.0.1)")
    p.add_argument("--launcher", default="",
                   help="mpirun (default when found) or torchrun underneath; DeepSpeed's "
                   "MPI names (openmpi, mpich, impi, mvapich) mean mpirun")
    p.add_argument("--module", action="store_true", help="user_script is a module (python -m)")
    p.add_argument("--no_python", action="store_true",
                   help="user_script is an executable, not a Python file")
    p.add_argument("--no_local_rank", action="store_true",
                   help="do not pass --local_rank to the script")
    # DeepSpeed's multi-node and tooling flags, parsed as
    # DeepSpeed parses them and refused when set (_refused)
    for flag, kind in (("--launcher_args", str), ("--ssh_port", int), ("--node_rank", int),
                       ("--min_elastic_nodes", int), ("--max_elastic_nodes", int),
                       ("--bind_core_list", str), ("--autotuning", str),
                       ("--enable_each_rank_log", str), ("--comment", str), ("--account", str)):
        p.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)
    for flag in ("--no_ssh", "--no_ssh_check", "--force_multi", "--elastic_training",
                 "--bind_cores_to_rank", "--save_pid"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("user_script", help="the training script, then its own arguments")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def _devices(spec: str, flag: str, error) -> dict[str, list[int] | None]:
    """DeepSpeed's host:ids@host:ids form -> {host: [ids] or None (all of them)}."""
    out = {}
    for part in filter(None, spec.split("@")):
        host, _, ids = part.partition(":")
        try:
            out[host] = sorted({int(i) for i in ids.split(",")}) if ids else None
        except ValueError:
            error(f"{flag} {spec!r}: expected DeepSpeed's form host:0,1 (device numbers), e.g. "
                  "localhost:0,1")
    return out


def _hostfile_hosts(path: str, error) -> dict[str, int]:
    if not os.path.isfile(path):
        error(f"--hostfile {path}: no such file")
    hosts = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            host, _, slots = line.partition(" slots=")
            if not slots.strip().isdigit():
                error(f"--hostfile {path}: line {line!r} is not DeepSpeed's 'hostname slots=N'")
            hosts[host.strip()] = int(slots)
    return hosts


def ranks_and_devices(args, error, gpus: int) -> tuple[int, list[int] | None]:
    """How many ranks on this machine, and which GPUs (None on CPU), from DeepSpeed's flags."""
    multi = ("minizero runs one node from this command; for several, start mpirun or torchrun on "
             "each node (docs/nodes.md)")
    if args.num_nodes not in (-1, 1):
        error(f"--num_nodes {args.num_nodes}: {multi}")
    slots = None
    if args.hostfile is not None:
        hosts = _hostfile_hosts(args.hostfile, error)
        if len(hosts) > 1 or not set(hosts) <= LOCAL_HOSTS:
            error(f"--hostfile {args.hostfile} names {sorted(hosts)}: {multi}")
        slots = next(iter(hosts.values()), None)
    if (args.include or args.exclude) and args.num_gpus != -1:
        error("--include/--exclude and --num_gpus: give one of them (as DeepSpeed)")
    if args.include and args.exclude:
        error("--include and --exclude: give one of them (as DeepSpeed)")
    if args.num_gpus == 0 or args.num_gpus < -1:
        error(f"--num_gpus {args.num_gpus}: give a positive number of ranks")
    available = gpus or slots or 1
    if args.num_gpus > 0:
        if gpus and args.num_gpus > gpus:
            error(f"--num_gpus {args.num_gpus}: this machine has {gpus} GPUs")
        ids = list(range(args.num_gpus))
    else:
        ids = list(range(slots if slots else available))
    for flag, spec in (("--include", args.include), ("--exclude", args.exclude)):
        if not spec:
            continue
        chosen = _devices(spec, flag, error)
        if not set(chosen) <= LOCAL_HOSTS:
            error(f"{flag} {spec!r} names {sorted(set(chosen) - LOCAL_HOSTS)}: {multi}")
        named = sorted({i for v in chosen.values() if v for i in v})
        if gpus and any(i >= gpus for i in named):
            error(f"{flag} {spec!r}: this machine has GPUs 0..{gpus - 1}")
        if flag == "--include":
            ids = named if named else ids
        else:
            ids = (
                []
                if any(v is None for v in chosen.values())
                else [i for i in ids if i not in named]
            )
    if not ids:
        error(f"--exclude {args.exclude!r} leaves no device to run on")
    return len(ids), (ids if gpus else None)


def _refused(args, error):
    for flag in ("launcher_args", "ssh_port", "node_rank", "min_elastic_nodes", "max_elastic_nodes",
                 "bind_core_list", "autotuning", "enable_each_rank_log", "comment", "account",
                 "no_ssh", "no_ssh_check", "force_multi", "elastic_training", "bind_cores_to_rank",
                 "save_pid"):
        # DeepSpeed's defaults, written out by a script, are no request: -1, "", "None"
        if getattr(args, flag) not in (None, False, -1, "", "None"):
            error(f"--{flag} is a DeepSpeed launcher flag minizero does not implement (it runs one "
                  "machine with mpirun or torchrun); leave it out")
    if args.module and args.no_python:
        error("--module and --no_python: give one of them")


def command(args, nranks: int, backend: str) -> list[str]:
    shim = [*(["--module"] if args.module else []), *(["--no_python"] if args.no_python else []),
            *(["--no_local_rank"] if args.no_local_rank else []), args.user_script, *args.user_args]
    if backend == "mpirun":
        from minizero.launch import find_mpirun
        return [find_mpirun(), "-n", str(nranks), sys.executable, "-m", "minizero.launcher.rank",
                *shim]
    return [sys.executable, "-m", "minizero", "torchrun", "--nproc-per-node", str(nranks),
            "--master-addr", args.master_addr or "127.0.0.1", "--master-port",
            str(args.master_port), "-m", "minizero.launcher.rank", *shim]


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    _refused(args, p.error)
    launcher = args.launcher or ("mpirun" if _has_mpirun() else "torchrun")
    launcher = "mpirun" if launcher in MPI_NAMES else launcher
    if launcher not in LAUNCHERS:
        p.error(f"--launcher {args.launcher!r}: use mpirun or torchrun ({', '.join(MPI_NAMES)} "
                "mean mpirun; pdsh and slurm start several nodes, which this command does not)")
    if not args.module and not args.no_python and not os.path.isfile(args.user_script):
        p.error(f"user_script {args.user_script}: no such file")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        p.error(f"--master_port {args.master_port}: give a port number 1..65535")
    import torch
    from minizero import env as mz_env
    try:
        mz_env.check()
    except mz_env.EnvError as e:
        p.error(str(e))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nranks, devices = ranks_and_devices(args, p.error, gpus)
    if nranks > mz_env.get("MINIZERO_MAX_RANKS"):
        p.error(f"{nranks} ranks: this machine allows at most {mz_env.get('MINIZERO_MAX_RANKS')} "
                "(MINIZERO_MAX_RANKS raises the cap when you have the cores)")
    # DeepSpeed's fixed 29500 is every other job's too: two jobs meeting at one store mix ranks
    chosen = args.master_port is None
    if chosen:
        from minizero.launch import free_port
        args.master_port = free_port()
    child = dict(os.environ, MASTER_ADDR=args.master_addr or "127.0.0.1",
                 MASTER_PORT=str(args.master_port))
    child.setdefault("OMP_NUM_THREADS", "1")
    if devices is not None:
        child["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    cmd = command(args, nranks, launcher)
    sys.stderr.write(f"minizero.launcher: {nranks} rank{'s' * (nranks > 1)} of {args.user_script} "
                     f"under {launcher}"
                     + (f" on GPUs {child['CUDA_VISIBLE_DEVICES']}" if devices is not None
                        else " on CPU")
                     + f", rendezvous port {args.master_port}"
                     + (" (free, chosen here; --master_port sets one)" if chosen else "") + "\n")
    try:
        return subprocess.call(cmd, env=child)
    except KeyboardInterrupt:
        return 130


def _has_mpirun() -> bool:
    from minizero.launch import LaunchError, find_mpirun
    try:
        find_mpirun()
        return True
    except LaunchError:
        return False


if __name__ == "__main__":
    sys.exit(main())
