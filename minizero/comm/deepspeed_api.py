"""DeepSpeed's `deepspeed.comm` functions on minizero's global Communicator (bytes counted in its
stats).

    import minizero as deepspeed
    deepspeed.init_distributed()
    if deepspeed.comm.get_rank() == 0: ...
    deepspeed.comm.all_reduce(t, op=deepspeed.comm.ReduceOp.AVG)

The names and arguments are deepspeed/comm/comm.py's. `group` is a minizero Communicator (from
`new_group(ranks)`, or a Mesh's sub-communicator) or None for the world; a torch ProcessGroup is
refused (minizero's collectives run on its own backends). Reduce ops: ReduceOp.SUM / AVG / MAX /
MIN, torch's ReduceOp of those names, or the strings. The profiling keywords (prof, log_name, debug)
are accepted and unused: minizero counts every op's bytes itself (`comm.get().stats`,
`log_summary()` prints them).
"""
from __future__ import annotations

import enum

import torch

from minizero.comm.communicator import get, init, init_torch_beside, is_initialized
from minizero.comm.launcher import local_rank


class ReduceOp(enum.Enum):
    """deepspeed.comm.ReduceOp's members that minizero's collectives implement."""
    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


def _op(op) -> str:
    # torch's RedOpType has .name
    name = op.value if isinstance(op, ReduceOp) else getattr(op, "name", op)
    name = str(name).lower()
    if name not in ("sum", "avg", "max", "min"):
        raise ValueError(f"deepspeed.comm: reduce op {op!r} is not implemented by minizero; use "
                         "ReduceOp.SUM, AVG, MAX or MIN")
    return name


def _group(group):
    if group is None:
        # DeepSpeed asserts here too; a silent world of one would hide a missing launch
        if not is_initialized():
            raise RuntimeError("deepspeed.comm: the backend is not initialized: call "
                               "deepspeed.init_distributed() (or deepspeed.initialize(...)) before "
                               "deepspeed.comm's functions")
        return get()
    if not hasattr(group, "all_reduce") or not hasattr(group, "stats"):
        raise TypeError("deepspeed.comm: group must be a minizero Communicator "
                        "(deepspeed.comm.new_group(ranks), or a Mesh's sub-communicator) or None "
                        f"for the world; got {type(group).__name__}")
    return group


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500,
                     verbose=True, timeout=None, init_method=None, dist_init_required=None,
                     config=None, rank=-1, world_size=-1):
    """deepspeed.init_distributed: starts minizero's global communicator from the launcher's
    environment (mpirun, torchrun or minizero.launcher; plain python is a world of one). The backend
    is minizero's choice (mpi under mpirun on CPU, gloo under torchrun, NCCL on CUDA); dist_backend
    'nccl' / 'gloo' asks for torch.distributed, 'mpi' for mpi4py. torch.distributed is started too,
    with the same rank and world, as DeepSpeed always does (its programs call it directly);
    minizero's collectives keep their own backend. rank / world_size given by hand are refused: a
    launcher sets them."""
    if rank != -1 or world_size != -1:
        raise ValueError("deepspeed.init_distributed: rank= and world_size= are not supported: "
                         "start the script with a launcher (python -m minizero.launcher, mpirun or "
                         "torchrun), which sets them")
    backend = {None: None, "mpi": "mpi", "nccl": "torch", "gloo": "torch", "ccl": None}.get(
        dist_backend, "?"
    )
    if backend == "?":
        raise ValueError(f"deepspeed.init_distributed: dist_backend {dist_backend!r} is not one "
                         "minizero has: use None (minizero's choice), 'nccl', 'gloo' or 'mpi'")
    world = get() if is_initialized() else init(backend)  # DeepSpeed's second call is a no-op too
    init_torch_beside(world)
    return world


def get_rank(group=None) -> int:
    return _group(group).rank


def get_world_size(group=None) -> int:
    return _group(group).size


def get_local_rank() -> int:
    """This process's index on its machine (the launcher's LOCAL_RANK): its GPU."""
    return local_rank()


def get_world_group():
    return get()


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The world rank of `group`'s rank `group_rank`."""
    group = _group(group)
    ranks = getattr(group, "parent_ranks", None)
    return group_rank if ranks is None else ranks[group_rank]


def new_group(ranks):
    """A sub-communicator of these world ranks; every rank calls it, non-members get None (as
    torch)."""
    return get().new_group(ranks)


def barrier(group=None, async_op=False, device_ids=None, prof=False, log_name="barrier",
            debug=None):
    _group(group).barrier()


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
               log_name="all_reduce", debug=None):
    return _group(group).all_reduce(tensor, _op(op), async_op=async_op)


inference_all_reduce = all_reduce


def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast",
              debug=None):
    """src is a rank of `group` (minizero's communicators number their own ranks)."""
    return _group(group).broadcast(tensor, src, async_op=async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="reduce",
           debug=None):
    return _group(group).reduce(tensor, dst, _op(op), async_op=async_op)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, prof=False,
                           log_name="all_gather_into_tensor", debug=None):
    return _group(group).all_gather(output_tensor, tensor, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather",
               debug=None):
    """torch's list form: tensor_list[r] receives rank r's tensor."""
    group = _group(group)
    if len(tensor_list) != group.size:
        raise ValueError(f"deepspeed.comm.all_gather: tensor_list has {len(tensor_list)} tensors "
                         f"for {group.size} ranks")
    flat = torch.empty(group.size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    group.all_gather(flat, tensor.contiguous())
    for out, part in zip(tensor_list, flat.chunk(group.size)):
        out.copy_(part.view_as(out))


def all_gather_object(object_list, obj, group=None, prof=False, log_name="all_gather_object",
                      debug=None):
    """object_list[r] = rank r's obj (pickled, a metadata exchange: not counted as tensor bytes)."""
    gathered = _group(group).allgather_object(obj)
    object_list[:len(gathered)] = gathered


def get_all_ranks_from_group(group=None) -> list[int]:
    """The world ranks of `group`'s members, in its rank order."""
    group = _group(group)
    return [get_global_rank(group, r) for r in range(group.size)]


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False,
                          prof=False, log_name="reduce_scatter_tensor", debug=None):
    return _group(group).reduce_scatter(output_tensor, tensor, _op(op), async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False,
                      prof=False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op, group=group, async_op=async_op)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False, prof=False, log_name="all_to_all_single", debug=None):
    if output_split_sizes is not None or input_split_sizes is not None:
        raise ValueError("deepspeed.comm.all_to_all_single: uneven splits (output_split_sizes / "
                         "input_split_sizes) are not implemented by minizero; give equal chunks")
    return _group(group).all_to_all(output, tensor, async_op=async_op)


def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    _group(group).send(tensor, dst, tag)


def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    if src is None:
        raise ValueError("deepspeed.comm.recv: give src (a receive from any rank is not "
                         "implemented by minizero)")
    _group(group).recv(tensor, src, tag)


def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    return _group(group).isend(tensor, dst, tag)


def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    if src is None:
        raise ValueError("deepspeed.comm.irecv: give src (a receive from any rank is not "
                         "implemented by minizero)")
    return _group(group).irecv(tensor, src, tag)


def log_summary(show_straggler=False, return_dict=False):
    """DeepSpeed's comms summary: here the bytes this rank's world communicator counted, per op
    (rank 0 prints); return_dict=True returns them ({op: {calls, payload_bytes, sent_bytes, ...}})
    on every rank. Latencies and straggler analysis are DeepSpeed's comms logger's, not measured
    here."""
    world = get()
    if world.rank == 0:
        print(world.stats)
    return world.stats.as_dict() if return_dict else None


DEEPSPEED_NAMES = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object",
                   "all_reduce", "all_to_all_single", "allgather_fn", "barrier", "broadcast",
                   "get_all_ranks_from_group", "get_global_rank", "get_local_rank", "get_rank",
                   "get_world_group", "get_world_size", "inference_all_reduce", "init_distributed",
                   "irecv", "isend", "log_summary", "new_group", "recv", "reduce",
                   "reduce_scatter_fn", "reduce_scatter_tensor", "send"]
