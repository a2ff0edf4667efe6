"""The top-k router: which experts each token goes to, with what weight, and the balancing loss.

Shazeer et al. 2017 ("Outrageously Large Neural Networks") route each token to k of E experts by a
softmax over a learned linear gate; GShard (Lepikhin et al. 2020) makes it trainable at scale with
a fixed expert CAPACITY and an auxiliary loss; Switch Transformer (Fedus et al. 2021) shows k = 1 is
enough. For a rank's T tokens x_t (one GShard "group"):

    p_t = softmax(x_t W_g)                 [E] router probabilities
    e_t1..e_tk = top-k(p_t)                the chosen experts, best first
    C = ceil(k * T * capacity_factor / E)  slots per expert (Switch eq. 3, x k for top-k as GShard)

Slots fill in priority order: every token's first choice (in token order) before any second choice
(GShard Algorithm 1), so a token that overflows an expert is DROPPED from it (its share of the
output is 0; the residual connection around the layer carries it on). The weights combining the
expert outputs are

    k = 1: g_t = p_t[e_t1]                         (Switch: the gradient reaches W_g through it)
    k = 2: g_tj = p_t[e_tj] kept_tj / sum_j' p_t[e_tj'] kept_tj'   (DeepSpeed's top2gating; GShard's
           Algorithm 1 normalizes over the two choices before the capacity cut)

The load-balancing loss (Switch eq. 4, GShard's l_aux, DeepSpeed's l_aux) pushes the router towards
an even split:

    aux = alpha * E * sum_i f_i P_i,   f_i = fraction of tokens whose FIRST choice is expert i,
                                       P_i = mean over tokens of p_t[i]

It is E * sum f_i P_i = 1 at a perfectly uniform router and grows to E when one expert takes all.
f_i is a count (no gradient): the loss reaches W_g through P_i.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minizero.moe.dispatch import expert_positions


def capacity(
    tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int = 1
) -> int:
    """Slots per expert: ceil(k * T * capacity_factor / E), at least min_capacity (DeepSpeed's,
    default 4 there)."""
    return max(min_capacity, math.ceil(k * tokens * capacity_factor / num_experts))


def load_balancing_loss(
    probs: torch.Tensor, first_choice: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """E * sum_i f_i P_i (Switch eq. 4 without alpha) of one group of tokens: probs [T, E],
    first_choice [T]."""
    fraction = F.one_hot(first_choice, num_experts).float().mean(0)  # f_i, a count: no gradient
    mean_prob = probs.float().mean(0)                                 # P_i
    return num_experts * (fraction * mean_prob).sum()


@dataclass
class Routing:
    """What the router decided for T tokens (k choices each)."""
    expert_index: torch.Tensor  # [T, k] int64: the chosen experts, best first
    # [T, k] int64: the slot of each choice inside its expert (may be >= capacity)
    positions: torch.Tensor
    kept: torch.Tensor          # [T, k] bool: position < capacity (False: dropped)
    gates: torch.Tensor         # [T, k] the combine weights (0 for a dropped choice)
    capacity: int               # C: slots per expert
    aux_loss: torch.Tensor      # alpha * E * sum_i f_i P_i (a scalar with a gradient)

    def tokens_per_expert(self, num_experts: int) -> list[int]:
        """How many choices each expert received, before the capacity cut."""
        return torch.bincount(self.expert_index.reshape(-1), minlength=num_experts).tolist()

    def kept_per_expert(self, num_experts: int) -> list[int]:
        """How many of them it processes (at most C each)."""
        return torch.bincount(self.expert_index[self.kept], minlength=num_experts).tolist()

    def dropped(self) -> int:
        """Choices that found their expert full."""
        return int((~self.kept).sum())


class TopKRouter(nn.Module):
    """softmax(x W_g), top-k, capacity, combine weights and the balancing loss (module
    docstring)."""

    def __init__(self, hidden: int, num_experts: int, k: int = 1, capacity_factor: float = 1.25,
                 aux_loss_coef: float = 0.01, positions=expert_positions, min_capacity: int = 1):
        super().__init__()
        if k not in (1, 2) or k > num_experts:
            raise ValueError(f"TopKRouter: k={k}, but k must be 1 or 2 and at most "
                             f"num_experts={num_experts}")
        if not capacity_factor > 0:
            raise ValueError(f"TopKRouter: capacity_factor={capacity_factor} must be > 0")
        # W_g: a dense parameter, replicated over dp
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.num_experts = num_experts          # E
        self.k = k                              # choices per token
        self.capacity_factor = capacity_factor  # slots per expert relative to an even split
        self.aux_loss_coef = aux_loss_coef      # alpha of the balancing loss (Switch uses 1e-2)
        self.positions = positions  # the slot-assignment function (lab 12 swaps in its own)
        self.min_capacity = min_capacity  # the fewest slots per expert (DeepSpeed's min_capacity)

    def forward(self, tokens: torch.Tensor) -> Routing:
        # [T, E], fp32 as every MoE code base does
        probs = F.softmax(self.gate(tokens).float(), dim=-1)
        top_probs, expert_index = probs.topk(self.k, dim=-1)   # [T, k]
        cap = capacity(tokens.shape[0], self.num_experts, self.k, self.capacity_factor,
                       self.min_capacity)
        positions, kept = self.positions(expert_index, self.num_experts, cap)
        gates = top_probs * kept
        # DeepSpeed's top2gating: normalize over the kept choices (both dropped: 0, the residual)
        if self.k > 1:
            gates = gates / gates.sum(-1, keepdim=True).clamp_min(torch.finfo(gates.dtype).eps)
        aux = self.aux_loss_coef * load_balancing_loss(probs, expert_index[:, 0], self.num_experts)
        return Routing(expert_index, positions, kept, gates.to(tokens.dtype), cap, aux)
