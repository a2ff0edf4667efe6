"""Who started this process, read from its environment, before any communicator exists.

A launcher announces each rank's place in the job through environment variables:
  * mpirun / mpiexec: MPICH's PMI_RANK, PMI_SIZE (and PMI_LOCAL_RANK, MPI_LOCALRANKID), Open MPI's
    OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK, PMIX_RANK;
  * torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (a script that sets them for
    mp.spawn counts as torchrun);
  * plain python: none of them, a world of one.
Nodes (the Mesh's default, comm/mesh.py): how many ranks the launcher started on this rank's
machine, torchrun's LOCAL_WORLD_SIZE, MPICH's MPI_LOCALNRANKS, Open MPI's
OMPI_COMM_WORLD_LOCAL_SIZE; and which node it is, torchrun's GROUP_RANK (the agent's node rank:
several agents may share a host), MPICH's PMI_HOSTNAME (the host as the hostfile or -hosts names
it), else the hostname (Open MPI, srun). Reading them needs no collective, so a rank can check its
input, pick its device or report an error before the job's ranks have met. communicator.py (backend
and device choice) and backends.py (the torch.distributed rendezvous) both read the launcher through
this module only.
"""
from __future__ import annotations

import os
import socket

# env.py checks the variables before anything starts and must name rank 0 without importing comm/
# (the layers flow one way): the launched rank is read there
from minizero.env import launched_rank  # noqa: F401  (comm.launched_rank())

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


def launched_world_size() -> int:
    """The world size a launcher (mpirun: PMI_SIZE / OMPI_COMM_WORLD_SIZE; torchrun: WORLD_SIZE)
    announced, read from the environment WITHOUT creating a communicator: 1 outside a launcher.
    Lets a caller fail on bad input before any collective (the engine's config checks)."""
    return max(int(os.environ.get(v, "1")) for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                                     "WORLD_SIZE"))


# torchrun, MPICH, Open MPI
LOCAL_SIZE_ENV = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def local_world_size() -> int | None:
    """How many ranks the launcher started on this rank's node (torchrun's LOCAL_WORLD_SIZE, MPICH's
    MPI_LOCALNRANKS, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE); None when no launcher says."""
    for var in LOCAL_SIZE_ENV:
        if var in os.environ:
            return int(os.environ[var])
    return None


def node_name() -> str:
    """Which node the launcher put this rank on: "torchrun node <GROUP_RANK>" (the agent's node
    rank; two agents on one host are two nodes), MPICH's PMI_HOSTNAME (the host as its hostfile
    names it), else the hostname. Ranks with the same name are on the same node."""
    if "GROUP_RANK" in os.environ:
        return f"torchrun node {os.environ['GROUP_RANK']}"
    if "PMI_HOSTNAME" in os.environ:
        return os.environ["PMI_HOSTNAME"]
    return socket.gethostname()
