"""Mesh: one grid of ranks, the single source of truth for every parallel group.

3D parallelism puts each rank at a coordinate (d, p, t) of a dp x pp x tp grid, and context
parallelism (minizero/context: the sequence split over cp ranks) adds a fourth axis, c:

    grid = arange(world).view(dp, pp, cp, tp)    world rank = ((d * pp + p) * cp + c) * tp + t

and every group is a line through that grid: the tp group of a rank varies t with (d, p, c) fixed,
its cp group varies c, its pp group varies p, its dp group varies d. TP varies fastest, so a tp
group is made of neighbouring ranks (one server: TP needs the fastest links), CP next (ring
attention's K/V blocks every layer), PP next, DP outermost. This is the order of Megatron-LM's
default (tp-cp-dp-pp) and of picotron's `ProcessGroupManager`. With cp = 1 it is the dp x pp x tp
grid.

Nodes: `node_size` consecutive world ranks form a node. By default (node_size=None) the nodes are
the launcher's (comm/launcher.py reads them): the whole world when the launcher put every rank on
one machine (its local size, LOCAL_WORLD_SIZE / MPI_LOCALNRANKS / OMPI_COMM_WORLD_LOCAL_SIZE, equals
the world: plain mpirun or torchrun on one machine), else one small all-gather of each rank's node
name (torchrun's GROUP_RANK, MPICH's PMI_HOSTNAME, the hostname), which must give consecutive blocks
of equal size (a MeshError otherwise: torchrun always does; mpirun does with -ppn N / --map-by slot,
not round-robin). An explicit `node_size` wins: that is how nodes are simulated on one machine
(lessons 08, 10, 11). ZeRO++ (Wang et al. 2023) needs two more groups from that: the `node` group
(the ranks of one server) and the `cross_node` group (the ranks with the same local index on every
server). A tp group must fit inside a node, so `node_size` must be a multiple of `tp`.

Expert parallelism (minizero/moe) is not another axis of the grid: DeepSpeed-MoE cuts each dp
group into slices of `ep` consecutive ranks. The experts are shared out over a slice (`mesh.ep`,
the all-to-all group) and replicated across slices (`mesh.expert_dp`, the ranks that all-reduce
the same experts' gradients); dense parameters stay replicated over the whole dp group.

    mesh = Mesh(comm, dp=2, pp=2, tp=2)            # on 8 ranks
    mesh.tp.all_reduce(x)                          # the 2 ranks of this rank's tp group
    mesh.pp.send(act, mesh.pp_next)                # pipeline neighbour, a rank of mesh.pp

The Mesh also tells `comm` which node each rank is on (`comm.set_nodes`): from then on every
byte sent through `comm` or a group split from it is booked as intra- or cross-node in its
stats (comm/stats.py says how). The last Mesh built on a communicator defines its nodes.

The sub-communicators are built once, here, with `Communicator.split` (every rank calls every
split, in the same order), and count their bytes into the world's stats as well as their own.
The mesh is passed explicitly to whatever needs it, as `comm=` is: there is no global mesh.
"""
from __future__ import annotations

import torch

from minizero.comm.communicator import Communicator
from minizero.comm.launcher import (
    launched_world_size,
    launcher,
    local_world_size,
    node_name,
)

AXES = ("dp", "pp", "cp", "tp")


class MeshError(ValueError):
    """Sizes that do not describe the world: the message names them."""


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshError(f"Mesh: {name} must be a positive int, got {value!r}")
    return value


def nodes_from_launcher(comm) -> int:
    """Ranks per node as the launcher placed `comm`'s ranks (module docstring): comm.size when the
    whole job is on one machine (no collective: every rank's local size equals the world then),
    otherwise from one all-gather of node names; a MeshError, on every rank alike, unless they form
    consecutive blocks of equal size."""
    local = local_world_size()
    if comm.size == 1 or launcher() == "none" or local == launched_world_size():
        return comm.size
    nodes = {}  # node name -> its ranks of comm, in rank order
    for rank, name in enumerate(comm.allgather_object(node_name())):
        nodes.setdefault(name, []).append(rank)
    blocks = list(nodes.values())
    node_size = len(blocks[0])
    placed = "; ".join(f"{name}: ranks "
                       f"{ranks if len(ranks) <= 8 else str(ranks[:8])[:-1] + ', ...]'}"
                       for name,
                       ranks in list(nodes.items())[:6]) + ("; ..." if len(nodes) > 6 else "")
    if any(len(ranks) != node_size for ranks in blocks):
        raise MeshError(f"Mesh: the launcher's nodes hold different numbers of ranks ({placed}). "
                        "Launch the same number on every node (torchrun --nproc-per-node N, mpirun "
                        "-ppn N), or pass node_size= to choose the nodes yourself")
    if any(ranks != list(range(ranks[0], ranks[0] + node_size)) for ranks in blocks):
        raise MeshError("Mesh: the launcher's nodes are not consecutive blocks of ranks "
                        f"({placed}), so groups meant to stay inside a node would cross nodes. "
                        "Fill each node before the next (mpirun -ppn N or --map-by slot, not "
                        "round-robin), or pass node_size=")
    return node_size


class Mesh:
    """A dp x pp x cp x tp grid over `comm`'s ranks, plus nodes of `node_size` consecutive ranks."""

    def __init__(self, comm: Communicator, dp: int | None = None, pp: int = 1, tp: int = 1,
                 node_size: int | None = None, cp: int = 1, ep: int = 1):
        world = comm.size
        pp, tp, cp = _positive_int("pp", pp), _positive_int("tp", tp), _positive_int("cp", cp)
        model = pp * cp * tp
        sizes = f"pp={pp} x tp={tp}" + (f" x cp={cp}" if cp > 1 else "")
        if dp is None:  # the usual way to ask: "the rest is data parallel"
            if world % model:
                raise MeshError(f"Mesh: {sizes} = {model} does not divide the world size "
                                f"{world}: launch a multiple of {model} ranks")
            dp = world // model
        dp = _positive_int("dp", dp)
        if dp * model != world:
            raise MeshError(f"Mesh: dp={dp} x {sizes} = {dp * model} ranks, but the world has "
                            f"{world}: the sizes' product must equal the number of ranks")
        ep = _positive_int("ep", ep)
        if dp % ep:
            raise MeshError(f"Mesh: ep={ep} does not divide dp={dp}: expert parallelism shares the "
                            "experts out over slices of ep consecutive ranks of each dp group. "
                            f"Use an ep that divides {dp}")
        given = node_size is not None
        node_size = _positive_int("node_size", node_size) if given else nodes_from_launcher(comm)
        if world % node_size:
            raise MeshError(f"Mesh: node_size={node_size} does not divide the world size {world}")
        if node_size % tp:
            whose = "" if given else " (the launcher's: launch a multiple of tp ranks per node)"
            raise MeshError(f"Mesh: tp={tp} does not fit in nodes of {node_size} ranks{whose}: a "
                            "tp group would span two nodes, and TP's per-layer all-reduces need "
                            "the fast intra-node links. Use a node_size that is a multiple of tp")
        self.world = comm                  # every group below is a split of it
        self.dp_size = dp                  # data-parallel replicas (ZeRO shards over this axis)
        self.pp_size = pp                  # pipeline stages
        self.tp_size = tp                  # tensor-parallel ranks per layer
        self.cp_size = cp                  # context-parallel ranks: each holds s/cp of the sequence
        self.ep_size = ep  # expert-parallel ranks: a slice of the dp group sharing out the experts
        self.node_size = node_size  # ranks per server: the launcher's, or simulated (node_size=)
        self.node_source = "node_size" if given else "launcher"  # who chose the nodes (repr, tests)
        self.num_nodes = world // node_size
        self.grid = torch.arange(world).view(dp, pp, cp, tp)  # grid[d, p, c, t] = world rank
        coords = (self.grid == comm.rank).nonzero()[0].tolist()
        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = coords
        self.node_index = comm.rank // node_size   # which server this rank is on
        self.local_rank = comm.rank % node_size    # its index inside that server
        d, p, c, t = coords
        # bytes booked intra/cross-node from now on
        comm.set_nodes([r // node_size for r in range(world)])
        # color = which line through the grid; key = position on it (becomes the sub-rank)
        self.dp = comm.split((p * cp + c) * tp + t, d, name=f"dp{self.grid[:, p, c, t].tolist()}")
        self.pp = comm.split((d * cp + c) * tp + t, p, name=f"pp{self.grid[d, :, c, t].tolist()}")
        self.cp = comm.split((d * pp + p) * tp + t, c, name=f"cp{self.grid[d, p, :, t].tolist()}")
        self.tp = comm.split((d * pp + p) * cp + c, t, name=f"tp{self.grid[d, p, c, :].tolist()}")
        # expert parallelism cuts each dp group into slices of ep consecutive ranks (DeepSpeed-MoE's
        # layout): mesh.ep = this rank's slice (the all-to-all group), mesh.expert_dp = the ranks
        # holding the same experts (their gradients'
        # all-reduce group). ep = 1: no slice, expert_dp is dp.
        self.ep_rank = d % ep
        dp_line = self.grid[:, p, c, t].view(dp // ep, ep)
        self.ep = (
            self.dp.split(d // ep, d % ep, name=f"ep{dp_line[d // ep].tolist()}")
            if ep > 1
            else None
        )
        self.expert_dp = self.dp.split(d % ep, d // ep,
                                       name=f"expert_dp{dp_line[:, d % ep].tolist()}") \
            if ep > 1 else self.dp
        # dp x cp flattened (torchtitan's "dp_cp"): with cp > 1 every rank of a cp group holds the
        # gradient of its own tokens' loss, so the data-parallel strategy reduces (and shards) over
        # dp x cp (Megatron's "dp with cp"), ordered by (d, c). cp = 1: dp itself
        self.dp_cp = comm.split(p * tp + t, d * cp + c,
                                name=f"dp_cp{self.grid[:, p, :, t].reshape(-1).tolist()}") \
            if cp > 1 else self.dp
        self.node = comm.split(self.node_index, self.local_rank, name=f"node{self.node_index}")
        self.cross_node = comm.split(self.local_rank, self.node_index,
                                     name=f"cross_node{self.local_rank}")
        # pipeline neighbours, as ranks of self.pp (None at the ends: no wrap-around)
        self.pp_prev = p - 1 if p > 0 else None
        self.pp_next = p + 1 if p < pp - 1 else None
        self.is_first_stage = p == 0
        self.is_last_stage = p == pp - 1

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis` ('dp', 'pp', 'cp', 'tp', 'ep', 'expert_dp', 'node',
        'cross_node') as lists of world ranks."""
        if axis in ("ep", "expert_dp"):
            slices = self.grid.movedim(0, -1).reshape(-1, self.dp_size // self.ep_size,
                                                      self.ep_size)
            lines = slices if axis == "ep" else slices.transpose(1, 2)
            return sorted(line.tolist() for line in lines.reshape(-1, lines.shape[-1]))
        if axis in AXES:
            dim = AXES.index(axis)
            lines = self.grid.movedim(dim, -1).reshape(-1, self.grid.shape[dim])
            return sorted(line.tolist() for line in lines)
        nodes = torch.arange(self.world.size).view(self.num_nodes, self.node_size)
        if axis == "node":
            return nodes.tolist()
        if axis == "cross_node":
            return nodes.t().tolist()
        raise ValueError(f"unknown axis {axis!r}; use one of "
                         f"{AXES + ('ep', 'expert_dp', 'node', 'cross_node')}")

    def coords(self, rank: int) -> tuple[int, ...]:
        """(d, p, c, t) of a world rank."""
        return tuple((self.grid == rank).nonzero()[0].tolist())

    def same_node(self, rank_a: int, rank_b: int) -> bool:
        """Whether two world ranks are on the same server (the launcher's, or a simulated one)."""
        return rank_a // self.node_size == rank_b // self.node_size

    def __repr__(self):
        return (f"Mesh(dp={self.dp_size}, pp={self.pp_size}, cp={self.cp_size}, tp={self.tp_size}, "
                f"node_size={self.node_size} ({self.node_source}); rank {self.world.rank} at "
                f"(d={self.dp_rank}, p={self.pp_rank}, c={self.cp_rank}, t={self.tp_rank}), "
                f"node {self.node_index})")
