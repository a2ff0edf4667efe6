"""Who started this process, read from its environment, before any communicator exists.

A launcher announces each rank's place in the job through environment variables:
  * mpirun / mpiexec: MPICH's PMI_RANK, PMI_SIZE (and PMI_LOCAL_RANK, MPI_LOCALRANKID), Open MPI's
    OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK, PMIX_RANK;
  * torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (a script that sets them for
    mp.spawn counts as torchrun);
  * plain python: none of them, a world of one.
Reading them needs no collective, so a rank can check its input, pick its device or report an error
before the job's ranks have met. communicator.py (backend and device choice) and backends.py (the
torch.distributed rendezvous) both read the launcher through this module only.
"""
from __future__ import annotations

import os

MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")  # set by mpirun / mpiexec
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")   # set by torchrun (all four)


def launcher() -> str:
    """Who started this process, read from its environment: "mpi" (mpirun/mpiexec: MPICH's PMI_*,
    Open MPI's OMPI_*/PMIX_*), "torchrun" (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: torchrun,
    or a script that sets them for mp.spawn), or "none" (plain python: one rank)."""
    if any(v in os.environ for v in MPI_ENV):
        return "mpi"
    if all(v in os.environ for v in TORCHRUN_ENV):
        return "torchrun"
    return "none"


def local_rank() -> int:
    """This process's index among the ranks on its machine (0 outside a launcher): its GPU."""
    for var in ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def launched_rank() -> int:
    """This process's rank as the launcher announced it (PMI_RANK, OMPI_COMM_WORLD_RANK, RANK), read
    WITHOUT creating a communicator: lets rank 0 alone report an input error every rank finds."""
    for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK"):
        if v in os.environ:
            return int(os.environ[v])
    return 0


def launched_world_size() -> int:
    """The world size a launcher (mpirun: PMI_SIZE / OMPI_COMM_WORLD_SIZE; torchrun: WORLD_SIZE)
    announced, read from the environment WITHOUT creating a communicator: 1 outside a launcher.
    Lets a caller fail on bad input before any collective (the engine's config checks)."""
    return max(int(os.environ.get(v, "1")) for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"))
