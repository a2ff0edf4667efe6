"""Expert-data parallelism: dense gradients over the dp group, expert gradients over their own
group.

DeepSpeed-MoE (Rajbhandari et al. 2022) and Megatron-Core: on dp ranks with ep-rank expert
groups, a DENSE parameter (attention, router, embeddings) is replicated on all dp ranks, and an
EXPERT parameter on the dp/ep ranks of its expert-data-parallel group (mesh.expert_dp). With the
global loss L = (1/dp) sum_r L_r (every rank's mean over its own tokens):

    dense:   g = (1/dp) sum_{r in dp} dL_r/dW              all-reduce over dp, divide by dp
    expert:  g = (1/dp) sum_{r in expert_dp} G_r           all-reduce over expert_dp, divide by dp

where G_r is what backward left on rank r: through the all-to-all, the gradient of every token
of r's ep group that reached the expert. The divisor is dp (the ranks whose tokens reached the
expert: ep per rank of expert_dp), NOT expert_dp's size, which would make expert gradients ep times
too large.

Bytes per step (ring all-reduce, fp32 gradients, b = 4), Psi_d dense and Psi_e local expert
elements:
    2 (dp-1)/dp * Psi_d * b  +  2 (dp/ep - 1)/(dp/ep) * Psi_e * b
One flat buffer per group, one all-reduce each.
"""
from __future__ import annotations

import torch


def is_expert(param) -> bool:
    return getattr(param, "expert_parallel", False)


@torch.no_grad()
def _all_reduce_flat(grads: list[torch.Tensor], comm, divisor: int):
    if not grads or comm.size == 1 and divisor == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if comm.size > 1:
        comm.all_reduce(flat, op="sum")
    flat.div_(divisor)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def reduce_gradients(module: torch.nn.Module, dp_comm, expert_dp_comm):
    """After backward: every gradient becomes the global-batch mean's (module docstring). A
    parameter without a gradient contributes zeros, so every rank issues the same two
    all-reduces."""
    dense, expert = [], []
    for param in module.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        (expert if is_expert(param) else dense).append(param.grad)
    _all_reduce_flat(dense, dp_comm, dp_comm.size)
    _all_reduce_flat(expert, expert_dp_comm, dp_comm.size)


def gradient_bytes(module: torch.nn.Module, dp: int, ep: int, bytes_per: int = 4) -> dict:
    """The formula side: bytes each rank sends per step in the two all-reduces."""
    dense = sum(p.numel() for p in module.parameters() if not is_expert(p))
    expert = sum(p.numel() for p in module.parameters() if is_expert(p))
    edp = dp // ep
    return {"dense": 2 * (dp - 1) / dp * dense * bytes_per,
            "expert": 2 * (edp - 1) / edp * expert * bytes_per}
