"""minizero.comm: how ranks talk, and what it costs.

    communicator.py  Communicator: counted collectives, async handles, split/new_group;
                     init()/get(): the global one; select_backend_and_device: the ONE place
                     that picks backend and device
    backends.py      MPIBackend (mpi4py), TorchBackend (torch.distributed), Work handles
    launcher.py      who started this process (mpirun, torchrun, plain python), its launched rank
                     and world size, read from the environment before any communicator exists
    stats.py         CommStats, ring_bytes_sent: the bytes each op sends, counted where it runs;
                     ring_bytes_split: which of them cross a node
    mesh.py          Mesh: the dp x pp x tp (x node) grid of ranks and its sub-communicators
    watchdog.py      ending a job started by hand: the collective watchdog, one message per failure
    reaper.py        the process that names a rank killed without a word and removes the job
                     directory
    ring.py          ring all-reduce from send/recv (lab 01)
    deepspeed_api.py DeepSpeed's deepspeed.comm names (get_rank, all_reduce, ReduceOp, ...) on the
                     global communicator, so
                     `import minizero as deepspeed; deepspeed.comm.get_rank()` works
"""
from minizero.comm.communicator import (REDUCE_OPS, Communicator, get, init, is_initialized,
                                        select_backend_and_device, shutdown)
from minizero.comm.backends import Work, init_torch_distributed
# after the line above: the function `launcher`, not the module comm/launcher.py, is
# `minizero.comm.launcher`
from minizero.comm.launcher import launched_rank, launched_world_size, launcher, local_rank
from minizero.comm.mesh import Mesh, MeshError
from minizero.comm.stats import CommStats, OpStats, ring_bytes_sent, ring_bytes_split
from minizero.comm.deepspeed_api import (DEEPSPEED_NAMES, ReduceOp, all_gather,
                                         all_gather_into_tensor, all_gather_object, all_reduce,
                                         all_to_all_single, allgather_fn, barrier, broadcast,
                                         get_all_ranks_from_group, get_global_rank, get_local_rank,
                                         get_rank, get_world_group, get_world_size,
                                         inference_all_reduce, init_distributed, irecv, isend,
                                         log_summary, new_group, recv, reduce, reduce_scatter_fn,
                                         reduce_scatter_tensor, send)

__all__ = ["Communicator", "CommStats", "Mesh", "MeshError", "OpStats", "REDUCE_OPS", "Work", "get",
           "init", "init_torch_distributed", "is_initialized", "launched_rank",
           "launched_world_size", "launcher", "local_rank", "ring_bytes_sent", "ring_bytes_split",
           "select_backend_and_device", "shutdown", *DEEPSPEED_NAMES]
