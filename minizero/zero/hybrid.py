"""Hybrid sharding: ZeRO-3 inside each node, whole replicas across nodes (FSDP's HYBRID_SHARD,
MiCS).

    mesh = Mesh(comm, node_size=2)               # 4 ranks as 2 simulated nodes x 2 ranks
    model = HybridShard(TinyGPT(cfg), mesh)      # otherwise FSDP's API
    opt = torch.optim.SGD(model.parameters(), lr)
    loss = model(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()

Zhang et al. 2022, "MiCS: Near-linear Scaling for Training Gigantic Model on Public Cloud"
(scale-aware partitioning: shard over the smallest group that holds the model, replicate the rest;
hierarchical gradient synchronization), and torch FSDP's ShardingStrategy.HYBRID_SHARD: the model is
sharded over the k ranks of a node (mesh.node) exactly as ZeRO-3 (fsdp.py) shards it over a world of
k, and each node holds a whole copy. A step:

    forward / backward all-gathers     over mesh.node only          (never across nodes)
    gradients: reduce-scatter (avg)    over mesh.node        -> the node's average of its shard
               all-reduce (avg)        over mesh.cross_node  -> the average over all N = nodes*k

The average of the nodes' averages is the global average (every node has k ranks), so the model
trains as one process would. Per rank, with Psi parameters, M = the units' gathered bytes in the
compute dtype (Psi padded to a multiple of k), n = nodes:

    memory   parameters, gradients, optimizer state: Psi/k each (ZeRO-3: Psi/N)
    bytes    intra-node: (k-1)/k (M + M + M)        cross-node: 2 (n-1)/n * M/k

Cross-node bytes per node per step (k ranks), against zeropp.py's table for the same nodes:

      ZeRO-3         (N-1)/N (M + M + M)       -> 3M for large N
      hpZ            (N-1)/N (M + M)           -> 2M          (+ Psi/k parameter memory per rank)
      HybridShard    2 (n-1)/n M               -> 2M          (Psi/k for everything, instead of
                                                              Psi/N)

So hybrid sharding sends no more across nodes than hpZ and gathers nothing across nodes, and pays
for it with k-way instead of N-way sharding of the whole model state. (The ring model books one
rank per node as crossing for a world ring; the cross-node all-reduce crosses for every rank.)

Not supported (each refused with its reason): offload (FSDP.offload), models built under zero.Init,
a Mesh with pp, tp or cp > 1. Buffers: with broadcast_buffers, world rank 0's go to every node
(over mesh.cross_node, then the node's broadcast), as FSDP's go to every rank.
"""
from __future__ import annotations

import torch

from minizero.zero.fsdp import FSDP
from minizero.zero.init import built_with_init


def cross_node_bytes_per_node(
    gathered_numel: list[int], nodes: int, node_size: int, elem_bytes: int
) -> float:
    """2 (n-1)/n * M per node per step: each of its k ranks all-reduces its shard (M/k) with n-1
    replicas."""
    shard_bytes = sum(gathered_numel) // node_size * elem_bytes
    return node_size * 2 * (nodes - 1) / nodes * shard_bytes


class HybridShard(FSDP):
    """FSDP over mesh.node, gradient shards averaged over mesh.cross_node (module docstring)."""

    def __init__(self, module, mesh, sync_module_states: bool = True, **fsdp_kwargs):
        if mesh.pp_size * mesh.tp_size * mesh.cp_size != 1:
            raise ValueError(f"HybridShard shards over the nodes of all {mesh.world.size} ranks: "
                             f"build the Mesh with pp=tp=cp=1 (got pp={mesh.pp_size}, "
                             f"tp={mesh.tp_size}, cp={mesh.cp_size})")
        if built_with_init(module) is not None:
            raise ValueError("HybridShard: a model built under zero.Init is materialized shard by "
                             "shard over one group; build the model normally (each node holds a "
                             "whole copy anyway)")
        # one model on every node: world rank 0's (FSDP's own broadcast stays in the node)
        if sync_module_states:
            mesh.world.broadcast_tensors(list(module.parameters()))
        super().__init__(module, mesh.node, **fsdp_kwargs)
        self.mesh = mesh                   # nodes: mesh.node shards, mesh.cross_node replicates
        self.replicas = mesh.cross_node    # the ranks holding the same shard on the other nodes

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.replicas.size > 1 and torch.is_grad_enabled():
            # node rank 0s get world rank 0's
            self.replicas.broadcast_tensors(list(self.module.buffers()))
        return super().forward(*args, **kwargs)

    def _reduce_shard_grad(self, unit, g):
        """The node's reduce-scatter (FSDP's), then the average of that shard over the nodes, in the
        compute dtype."""
        shard_grad = super()._reduce_shard_grad(unit, g)
        if shard_grad is None or self.replicas.size == 1:
            return shard_grad
        wire = shard_grad if shard_grad.dtype == self.dtype else shard_grad.to(self.dtype)
        self.replicas.all_reduce(wire, op="avg")
        return wire.float()

    def _accumulate(self, unit, part, grad):
        # persistent parameters: FSDP averaged them in the node
        if part == "whole" and self.replicas.size > 1:
            self.replicas.all_reduce(grad, op="avg")
        super()._accumulate(unit, part, grad)

    def offload(self, *args, **kwargs):
        raise ValueError("HybridShard does not offload: its gradient shards are averaged across "
                         "nodes after the node's reduce-scatter, which the offload path (gradients "
                         "straight to the host) skips")

    def extra_repr(self) -> str:
        return (f"hybrid: sharded over nodes of {self.mesh.node_size}, {self.replicas.size} "
                "replicas, ") + \
            super().extra_repr()
