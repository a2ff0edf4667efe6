"""One rank of `python -m minizero.launcher`:
`python -m minizero.launcher.rank [--module|--no_python] [--no_local_rank] script args...`, started
by mpirun or torchrun.

It gives the script what DeepSpeed's launch.py gives each process: RANK, LOCAL_RANK, WORLD_SIZE and
LOCAL_WORLD_SIZE in the environment (read from mpirun's or torchrun's own variables; under mpirun,
minizero's communicator still sees mpirun and uses its MPI backend on CPU) and `--local_rank=K` as
the last argument, then runs the script as `python script.py` would (its folder first on sys.path,
__name__ "__main__").
"""
from __future__ import annotations

import os
import runpy
import sys

from minizero.comm.launcher import launched_rank, launched_world_size, local_rank, local_world_size


def main(argv: list[str]) -> None:
    flags = set()
    while argv and argv[0] in ("--module", "--no_python", "--no_local_rank"):
        flags.add(argv.pop(0))
    script, args = argv[0], argv[1:]
    rank, local = launched_rank(), local_rank()
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(local))
    os.environ.setdefault("WORLD_SIZE", str(launched_world_size()))
    local_size = local_world_size()
    if local_size is not None:
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(local_size))
    if "--no_local_rank" not in flags:
        args = [*args, f"--local_rank={local}"]  # DeepSpeed's launch.py passes it the same way
    if "--no_python" in flags:
        os.execvp(script, [script, *args])
    if "--module" in flags:
        sys.argv = [script, *args]
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
