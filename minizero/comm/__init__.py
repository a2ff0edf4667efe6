"""minizero.comm: how ranks talk, and what it costs.

    communicator.py  Communicator: counted collectives, async handles, split/new_group;
                     init()/get(): the global one; select_backend_and_device: the ONE place
                     that picks backend and device
    backends.py      MPIBackend (mpi4py), TorchBackend (torch.distributed), Work handles
    stats.py         CommStats, ring_bytes_sent: the bytes each op sends, counted where it runs
    mesh.py          Mesh: the dp x pp x tp (x node) grid of ranks and its sub-communicators
    ring.py          ring all-reduce from send/recv (lab 01)
"""
from minizero.comm.communicator import (REDUCE_OPS, Communicator, get, init, is_initialized,
                                        launched_world_size, local_rank, select_backend_and_device,
                                        shutdown)
from minizero.comm.backends import Work, init_torch_distributed
from minizero.comm.mesh import Mesh, MeshError
from minizero.comm.stats import CommStats, OpStats, ring_bytes_sent

__all__ = ["Communicator", "CommStats", "Mesh", "MeshError", "OpStats", "REDUCE_OPS", "Work", "get", "init",
           "init_torch_distributed", "is_initialized", "launched_world_size", "local_rank", "ring_bytes_sent",
           "select_backend_and_device", "shutdown"]
