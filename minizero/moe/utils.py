"""DeepSpeed's deepspeed/moe/utils.py helpers for the optimizer's param groups.

    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": model.parameters(), "lr": 1e-3})
    engine, optimizer, _, _ = minizero.initialize(model=model, model_parameters=groups, config=cfg)

As in DeepSpeed, each group is split into its dense parameters (the group as it was) and, for each
expert group name (`ep_size_<ep>`, set by MoE on its experts), a group of those experts with
`"moe": True` and `"name"`, cut into pieces of at most max_group_size elements. A group left with no
parameters is dropped.
"""
from __future__ import annotations

import torch

from minizero.moe.expert_data_parallel import is_expert


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether `param` belongs to an expert (DeepSpeed: allreduce=False; minizero:
    expert_parallel)."""
    return is_expert(param)


def split_params_into_shared_and_expert_params(params):
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups, max_group_size: int = 178956971
) -> list[dict]:
    """DeepSpeed's splitter: param_groups is a dict, a list of dicts, or a tuple of them."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, (list, tuple)):
        raise ValueError("split_params_into_different_moe_groups_for_optimizer: param_groups must "
                         "be a dict or a list of dicts (torch's param groups), got "
                         f"{type(param_groups).__name__}")
    out = []
    for group in param_groups:
        params = list(group["params"])
        dense = [p for p in params if not is_moe_param(p)]
        if dense:
            out.append({**group, "params": dense})
        by_name: dict[str, list] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(getattr(p, "group_name", "experts"), []).append(p)
        for name, experts in by_name.items():
            piece, numel = [], 0
            # DeepSpeed's cut: a new group once max_group_size elements are reached
            for p in experts:
                if piece and numel + p.numel() > max_group_size:
                    out.append({**group, "params": piece, "moe": True, "name": name})
                    piece, numel = [], 0
                piece.append(p)
                numel += p.numel()
            out.append({**group, "params": piece, "moe": True, "name": name})
    return out
