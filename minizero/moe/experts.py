"""The experts: E two-layer MLPs (d -> f -> d, GeLU), this rank holding E/ep of them.

Every expert is the transformer's feed-forward block: 2 * d * f + f + d parameters. Kept as
batched weights w1 [E/ep, d, f], w2 [E/ep, f, d] so that all local experts run in one bmm each,
as DeepSpeed-MoE's and Megatron's grouped experts do. Expert i of the full set is on rank
i // (E/ep) of the expert-parallel group, at local index i % (E/ep).

Initialization is the FULL set of E experts drawn from the global RNG (each like nn.Linear),
then this rank's slice: with the same seed on every rank the experts ARE the single-process ones,
the CPU initialization of minizero.tensor.

Each expert parameter carries `expert_parallel = True` (its gradient is all-reduced over the
expert-data-parallel group, expert_data_parallel.py) and `expert_parallel_dim = 0` (the full
tensor = the ep ranks' slices concatenated along dim 0).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def full_experts(
    num_experts: int, hidden: int, ffn: int, dtype=torch.float32
) -> dict[str, torch.Tensor]:
    """The E experts' weights as nn.Linear would initialize each, stacked: {w1, b1, w2, b2}."""
    first = [nn.Linear(hidden, ffn, dtype=dtype) for _ in range(num_experts)]
    second = [nn.Linear(ffn, hidden, dtype=dtype) for _ in range(num_experts)]
    return {"w1": torch.stack([lin.weight.detach().t() for lin in first]),   # [E, d, f]
            "b1": torch.stack([lin.bias.detach() for lin in first]),         # [E, f]
            "w2": torch.stack([lin.weight.detach().t() for lin in second]),  # [E, f, d]
            "b2": torch.stack([lin.bias.detach() for lin in second])}        # [E, d]


class Experts(nn.Module):
    """E/ep expert MLPs run on [E/ep, n, d] inputs (n tokens per expert), one bmm per layer."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, ep_rank: int = 0, ep_size: int = 1,
                 dtype=torch.float32):
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"Experts: num_experts={num_experts} is not divisible by the "
                             f"expert-parallel size {ep_size}: each of the {ep_size} ranks must "
                             "hold the same number of experts")
        self.num_experts = num_experts           # E: in the whole model
        self.num_local = num_experts // ep_size  # E/ep: on this rank
        self.first_expert = ep_rank * self.num_local  # global index of local expert 0
        local = slice(self.first_expert, self.first_expert + self.num_local)
        for name, full in full_experts(num_experts, hidden, ffn, dtype).items():
            param = nn.Parameter(full[local].clone())
            param.expert_parallel = True     # reduced over expert_dp, not dp
            param.expert_parallel_dim = 0    # full = cat of the ep ranks' slices along dim 0
            setattr(self, name, param)

    @torch.no_grad()
    def shard(self, ep_rank: int, ep_size: int):
        """Keep only this rank's E/ep experts of the E this module holds (built with ep_size 1):
        what the engine does when it learns the expert-parallel group (moe/moe.py's
        MoE.set_expert_parallel)."""
        if self.num_local != self.num_experts:
            raise ValueError(f"Experts.shard: this module already holds {self.num_local} of "
                             f"{self.num_experts} experts")
        if self.num_experts % ep_size:
            raise ValueError(f"Experts: num_experts={self.num_experts} is not divisible by the "
                             f"expert-parallel size {ep_size}: each of the {ep_size} ranks must "
                             "hold the same number of experts")
        self.num_local = self.num_experts // ep_size
        self.first_expert = ep_rank * self.num_local
        for name in ("w1", "b1", "w2", "b2"):
            old = getattr(self, name)
            param = nn.Parameter(old[self.first_expert:self.first_expert + self.num_local].clone())
            # DeepSpeed's expert-group tag (MoE sets it; moe/utils.py reads it)
            if hasattr(old, "group_name"):
                param.group_name = old.group_name
            param.expert_parallel = True
            param.expert_parallel_dim = 0
            setattr(self, name, param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(torch.baddbmm(self.b1.unsqueeze(1), x, self.w1))
        return torch.baddbmm(self.b2.unsqueeze(1), hidden, self.w2)

    def extra_repr(self):
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local - 1} of "
                f"{self.num_experts}, d={self.w1.shape[1]}, f={self.w1.shape[2]}")
