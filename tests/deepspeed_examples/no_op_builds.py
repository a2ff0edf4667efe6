"""Runs a script under real DeepSpeed with its just-in-time C++ op builds off, as DeepSpeed's launcher starts it:

    deepspeed --num_gpus 2 no_op_builds.py script.py ARGS   (each rank: no_op_builds.py --local_rank=K script.py ARGS)

On CPU, DeepSpeed's init_distributed compiles a shared-memory all-reduce op (deepspeed_shm_comm: about 2 minutes
on 2 busy cores, once per machine, cached under ~/.cache/torch_extensions) that only its inference all-reduce
uses. Reporting no op as buildable makes DeepSpeed take its own fallback (gloo), as on a machine without a
compiler, so the comparison never compiles anything; the script's optimizers are torch's (`torch_adam`).
"""
import runpy
import sys

import deepspeed.ops

deepspeed.ops.__compatible_ops__ = {}  # read with .get(name, False): no op is buildable

args = sys.argv[1:]
at = next(i for i, a in enumerate(args) if a.endswith(".py"))
sys.argv = [args[at], *args[at + 1:], *args[:at]]  # the launcher's --local_rank=K goes after the script's name
runpy.run_path(args[at], run_name="__main__")
