"""`accelerate launch` for minizero scripts: python -m minizero.accelerate.launch [flags] script.py
[args].

    python -m minizero.accelerate.launch --config_file default_config.yaml train.py --epochs 2

It reads Accelerate's config YAML (--config_file, else $ACCELERATE_CONFIG_FILE, else Accelerate's
default path), lets the flags below override it, exports the ACCELERATE_* variables
`accelerate launch` exports (accelerate/utils/launch.py) and starts num_processes ranks of the
script with mpirun (torchrun when there is no mpirun). A bad key or value is one line naming it,
exit 2, before any rank starts.

Flags (Accelerate's names): --config_file, --num_processes, --mixed_precision, --cpu,
--use_deepspeed, --zero_stage, --offload_optimizer_device, --offload_param_device,
--gradient_accumulation_steps, --gradient_clipping, --deepspeed_config_file, --use_fsdp,
--fsdp_sharding_strategy, --main_process_port, -m/--module. Anything else of Accelerate's
(multi-node, TPU, dynamo, Megatron-LM) is refused by argparse.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from minizero.accelerate import config as acc_config
from minizero.runtime.config import ConfigError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minizero.accelerate.launch", allow_abbrev=False,
                                description="Accelerate's launch, running minizero's Accelerator "
                                            "ranks")
    p.add_argument("--config_file", default=None,
                   help="Accelerate's config YAML (default: Accelerate's path)")
    p.add_argument("--num_processes", type=int, default=None,
                   help="ranks to start (default: the config's)")
    p.add_argument("--mixed_precision", choices=acc_config.MIXED_PRECISION, default=None)
    p.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    p.add_argument("--use_deepspeed", action="store_true")
    p.add_argument("--zero_stage", type=int, choices=(0, 1, 2, 3), default=None)
    p.add_argument("--offload_optimizer_device", choices=acc_config.OFFLOAD_DEVICES, default=None)
    p.add_argument("--offload_param_device", choices=acc_config.OFFLOAD_DEVICES, default=None)
    p.add_argument("--gradient_accumulation_steps", type=int, default=None)
    p.add_argument("--gradient_clipping", type=float, default=None)
    p.add_argument("--deepspeed_config_file", default=None)
    p.add_argument("--use_fsdp", action="store_true")
    p.add_argument("--fsdp_sharding_strategy", default=None)
    p.add_argument("--main_process_port", type=int, default=None,
                   help="the rendezvous port (default: a free one, said on stderr)")
    p.add_argument("-m", "--module", action="store_true", help="the script is a module (python -m)")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def environment(args) -> tuple[dict, int]:
    """The variables the ranks get and how many ranks; ConfigError for a bad config or flag."""
    path = args.config_file or os.environ.get("ACCELERATE_CONFIG_FILE")
    if path is None and os.path.isfile(acc_config.default_config_file()):
        path = acc_config.default_config_file()
    cfg = acc_config.load_yaml(path) if path else {}
    out, nprocs = acc_config.yaml_to_env(cfg, path or "flags")
    flags = {"ACCELERATE_MIXED_PRECISION": args.mixed_precision,
             "ACCELERATE_DEEPSPEED_ZERO_STAGE": args.zero_stage,
             "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": args.offload_optimizer_device,
             "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": args.offload_param_device,
             "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": args.gradient_accumulation_steps,
             "ACCELERATE_GRADIENT_CLIPPING": args.gradient_clipping,
             "ACCELERATE_DEEPSPEED_CONFIG_FILE": args.deepspeed_config_file,
             "FSDP_SHARDING_STRATEGY": args.fsdp_sharding_strategy}
    out.update({k: str(v) for k, v in flags.items() if v is not None})
    if args.use_deepspeed or args.zero_stage is not None or args.deepspeed_config_file:
        out["ACCELERATE_USE_DEEPSPEED"] = "true"
    if args.use_fsdp or args.fsdp_sharding_strategy:
        out["ACCELERATE_USE_FSDP"] = "true"
    if args.cpu:
        out["ACCELERATE_USE_CPU"] = "true"
    if args.gradient_accumulation_steps is not None and args.gradient_accumulation_steps < 1:
        raise ConfigError(f"--gradient_accumulation_steps {args.gradient_accumulation_steps}: use "
                          "a whole number >= 1")
    nprocs = args.num_processes if args.num_processes is not None else nprocs
    if nprocs < 1:
        raise ConfigError(f"--num_processes {nprocs}: use a whole number >= 1")
    # every value read back as the ranks will read it, so a bad one stops here, not on every rank
    from minizero import env as mz_env
    for name in out:
        try:
            mz_env.accelerate_get(name, out)
        except mz_env.EnvError as e:
            raise ConfigError(str(e)) from None
    return out, nprocs


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        extra, nprocs = environment(args)
    except ConfigError as e:
        sys.stderr.write(f"{p.prog}: {e}\n")
        return 2
    if not args.module and not os.path.isfile(args.training_script):
        sys.stderr.write(f"{p.prog}: training_script {args.training_script}: no such file\n")
        return 2
    from minizero import env as mz_env
    from minizero.launch import LaunchError, find_mpirun
    if nprocs > mz_env.get("MINIZERO_MAX_RANKS"):
        sys.stderr.write(
            f"{p.prog}: {nprocs} ranks: this machine allows at most "
            f"{mz_env.get('MINIZERO_MAX_RANKS')} (MINIZERO_MAX_RANKS raises the cap)\n"
        )
        return 2
    if args.main_process_port is not None and not 0 < args.main_process_port < 65536:
        sys.stderr.write(f"{p.prog}: --main_process_port {args.main_process_port}: give a port "
                         "number 1..65535\n")
        return 2
    # a fixed 29500 is every other job's too: two jobs meeting at one store mix their ranks
    port = args.main_process_port
    if port is None:
        from minizero.launch import free_port
        port = free_port()
        sys.stderr.write(f"{p.prog}: rendezvous port {port} (free, chosen here; "
                         "--main_process_port sets one)\n")
    child = {**os.environ, **extra, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    # the ranks read the variables, as under `accelerate launch`
    child.pop("ACCELERATE_CONFIG_FILE", None)
    child.setdefault("OMP_NUM_THREADS", "1")
    script = ["-m", args.training_script] if args.module else [args.training_script]
    try:
        cmd = [find_mpirun(), "-n", str(nprocs), sys.executable, *script,
               *args.training_script_args]
    except LaunchError:
        cmd = [sys.executable, "-m", "minizero", "torchrun", "--nproc-per-node", str(nprocs),
               "--master-port", str(port), *script, *args.training_script_args]
    try:
        return subprocess.call(cmd, env=child)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
