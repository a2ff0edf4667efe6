"""MoE: DeepSpeed's `deepspeed.moe.layer.MoE` signature on minizero's MoELayer (the engine's
ep_size).

    self.mlp = MoE(hidden_size=d, expert=4 * d, num_experts=8, ep_size=2, k=1, capacity_factor=1.25)
    out, l_aux, exp_counts = self.mlp(x)  # DeepSpeed's three outputs
    loss = task_loss + 0.01 * l_aux       # the auxiliary loss is the user's to add, as in DeepSpeed

DeepSpeed builds the layer inside the model before any process group exists; `deepspeed.initialize`
then creates the expert groups from `ep_size` and hands them to every MoE layer. minizero does the
same: the layer is built holding all E experts (drawn from the global RNG, so every rank and a
single process hold the same ones), and the engine (runtime/engine.py), once its Mesh(ep=ep_size)
exists, calls `set_expert_parallel(mesh.ep)`: each rank keeps its E/ep experts and the all-to-all
runs over mesh.ep. Expert parameters (param.expert_parallel) are then reduced over mesh.expert_dp
(world / ep ranks) and dense ones over mesh.dp, both divided by dp (expert_data_parallel.py gives
the equation).

Arguments, DeepSpeed's names and defaults except where said:
    expert            DeepSpeed deep-copies an nn.Module per expert. minizero's experts are batched
                      d -> f -> d GeLU MLPs (experts.py): give f (an int), or a module of two
                      nn.Linear (d -> f, f -> d; TinyGPT's GPTMLP), whose f is read (its weights are
                      not copied)
    k                 1 or 2 (top1gating / top2gating)
    capacity_factor, eval_capacity_factor, min_capacity: C = max(min_capacity, ceil(k T cf / E)),
                      cf = eval_capacity_factor in eval mode
    use_rts           DeepSpeed's default True (random token priority) is not implemented: minizero
                      keeps token order (GShard's priority), so its default is False and True is
                      refused
    use_residual, noisy_gate_policy, drop_tokens=False, used_token, use_tutel,
    enable_expert_tensor_parallelism: refused away from the default (a ValueError naming each)
l_aux is E * sum_i f_i P_i (DeepSpeed's l_aux, Switch eq. 4 without alpha); exp_counts the tokens
routed to each of the E experts by this rank's first choices (before the capacity cut).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from minizero.moe.moe_layer import MoELayer


def _ffn_width(expert, hidden_size: int) -> int:
    if isinstance(expert, int) and not isinstance(expert, bool):
        return expert
    linears = (
        [m for m in expert.modules() if isinstance(m, nn.Linear)]
        if isinstance(expert, nn.Module)
        else []
    )
    if (
        len(linears) != 2
        or linears[0].in_features != hidden_size
        or linears[1].out_features != hidden_size
        or linears[0].out_features != linears[1].in_features
    ):
        raise ValueError("MoE: expert must be the ffn width f (an int) or a module of two "
                         f"nn.Linear ({hidden_size} -> f, f -> {hidden_size}); got "
                         f"{type(expert).__name__}. minizero's experts are batched d -> f -> d "
                         "GeLU MLPs (minizero.moe.Experts)")
    return linears[0].out_features


class MoE(nn.Module):
    """deepspeed.moe.layer.MoE's arguments and outputs over a MoELayer (module docstring)."""

    def __init__(self, hidden_size: int, expert, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4, use_residual: bool = False, noisy_gate_policy=None,
                 drop_tokens: bool = True, use_rts: bool = False, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False):
        super().__init__()
        for name, value, default in (("use_residual", use_residual, False),
                                     ("noisy_gate_policy", noisy_gate_policy, None),
                                     ("drop_tokens", drop_tokens, True),
                                     ("use_rts", use_rts, False), ("use_tutel", use_tutel, False),
                                     ("enable_expert_tensor_parallelism",
                                      enable_expert_tensor_parallelism, False)):
            if value != default:
                raise ValueError(f"MoE: {name}={value!r} is not implemented in minizero (only "
                                 f"{default!r}): see minizero/moe/moe.py")
        if (isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1
                or num_experts % ep_size):
            raise ValueError(f"MoE: ep_size={ep_size!r} must be a positive int dividing "
                             f"num_experts={num_experts}: each expert-parallel rank holds "
                             "num_experts / ep_size experts")
        # aux_loss_coef 1: l_aux is returned unscaled, the user weighs it (DeepSpeed)
        self.layer = MoELayer(hidden_size, _ffn_width(expert, hidden_size), num_experts, None, k,
                              capacity_factor, aux_loss_coef=1.0)
        self.layer.router.min_capacity = min_capacity
        self.ep_size = ep_size  # the ranks sharing the experts out (the engine's Mesh ep)
        # DeepSpeed's tag: the optimizer param group of these experts
        for p in self.layer.experts.parameters():
            p.group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts                    # E
        self.capacity_factor = capacity_factor            # cf in training
        self.eval_capacity_factor = eval_capacity_factor  # cf in eval mode

    def set_expert_parallel(self, ep_comm):
        """The engine's hook: keep this rank's E/ep experts; the all-to-all runs over ep_comm
        (mesh.ep)."""
        if ep_comm.size != self.ep_size:
            raise ValueError(f"MoE: built with ep_size={self.ep_size}, given an expert-parallel "
                             f"group of {ep_comm.size}")
        self.layer.experts.shard(ep_comm.rank, ep_comm.size)
        self.layer.ep_comm = ep_comm

    def forward(self, hidden_states: torch.Tensor, used_token=None):
        if used_token is not None:
            raise ValueError("MoE: used_token is not implemented in minizero")
        self.layer.router.capacity_factor = (
            self.capacity_factor if self.training else self.eval_capacity_factor
        )
        out = self.layer(hidden_states)
        routing = self.layer.last_routing
        counts = torch.bincount(routing.expert_index[:, 0], minlength=self.num_experts)
        return out, self.layer.aux_loss, counts
