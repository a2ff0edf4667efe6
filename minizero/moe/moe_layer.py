"""MoELayer: router -> dispatch -> all-to-all -> experts -> all-to-all -> combine.

The feed-forward block of a transformer layer replaced by E experts (GShard, Switch, DeepSpeed-MoE's
`deepspeed.moe.layer.MoE(hidden_size, expert, num_experts, ep_size, k, capacity_factor)`); the
attention and everything else stay dense. With ep ranks in the expert-parallel group each holds
E/ep experts and ALL of its own tokens; tokens travel to their experts and back (dispatch.py):

    y = MoELayer(x)          x [..., d] -> y [..., d]; layer.aux_loss: add it to the task loss

Per layer and rank (b bytes per element, T tokens on this rank, C = ceil(k T cf / E)):
    expert parameters   E/ep * (2 d f + f + d)         (dense: the router's d * E)
    all-to-all bytes    4 * (ep - 1)/ep * E C d b per step (dispatch.all_to_all_bytes x 4)
    expert FLOPs        what a dense MLP of the same f pays per kept choice: k of E experts active

`last_routing` keeps the step's Routing (tokens per expert, dropped choices) for measurement.
"""
from __future__ import annotations

import types

import torch.nn as nn

from minizero.moe import dispatch as dispatch_ops
from minizero.moe.experts import Experts
from minizero.moe.router import TopKRouter


class MoELayer(nn.Module):
    """E experts over the ep ranks of `ep_comm` (None: all on this rank), top-k routing with
    capacity."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, ep_comm=None, k: int = 1,
                 capacity_factor: float = 1.25, aux_loss_coef: float = 0.01,
                 ops: types.ModuleType | None = None):
        super().__init__()
        ep_size = 1 if ep_comm is None else ep_comm.size
        ep_rank = 0 if ep_comm is None else ep_comm.rank
        # positions, dispatch, exchanges, combine (lab 12 passes its own)
        self.ops = ops or dispatch_ops
        self.router = TopKRouter(hidden, num_experts, k, capacity_factor, aux_loss_coef,
                                 self.ops.expert_positions)
        self.experts = Experts(num_experts, hidden, ffn, ep_rank, ep_size)
        self.ep_comm = ep_comm           # the all-to-all group (mesh.ep)
        self.num_experts = num_experts   # E
        self.aux_loss = None             # this forward's balancing loss (alpha included)
        self.last_routing = None         # this forward's Routing

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.router(tokens)
        ops, where = self.ops, (routing.expert_index, routing.positions, routing.kept)
        dispatched = ops.dispatch(tokens, *where, self.num_experts, routing.capacity)   # [E, C, d]
        expert_in = ops.exchange_to_experts(dispatched, self.ep_comm)  # [E/ep, ep*C, d]
        expert_out = ops.exchange_from_experts(self.experts(expert_in), self.ep_comm)  # [E, C, d]
        out = ops.combine(expert_out, *where, routing.gates)
        self.aux_loss, self.last_routing = routing.aux_loss, routing
        return out.view_as(x)
