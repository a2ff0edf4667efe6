"""DeepSpeed's launcher on one machine:
`python -m minizero.launcher --num_gpus 2 train.py --deepspeed ...`.

    runner.py   the command: DeepSpeed's flags (--num_gpus, --num_nodes, --hostfile, --include,
                --exclude, --master_addr, --master_port, --module, --no_python, --no_local_rank),
                the rank count, then mpirun (minizero's CPU default) or torchrun
                (`--launcher torchrun`) underneath
    rank.py     what each rank runs first: DeepSpeed's per-rank environment (RANK, LOCAL_RANK,
                WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and `--local_rank=K` appended to the script's
                arguments, then the script
"""
from minizero.launcher.runner import main

__all__ = ["main"]
