"""FSDPOptimizer: the optimizer of a ZeRO-3 model, stepping its flat fp32 shards in place.

    model = FSDP(TinyGPT(cfg))
    opt = FSDPOptimizer(model, torch.optim.AdamW, lr=1e-3)           # or param groups:
    opt = FSDPOptimizer(model, torch.optim.AdamW, [{"params": decay, "weight_decay": 0.1},
                                                   {"params": no_decay, "weight_decay": 0.0}],
                                                   lr=1e-3)
    loss = model(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()

A plain `torch.optim.AdamW(model.parameters())` works too: FSDP's parameters are this rank's local
parts (views of the shards) with .grad views of the reduce-scattered gradient, so torch steps them
one by one, exactly as it would the whole ones. FSDPOptimizer steps the same elements, in ONE run
per unit shard and param group (flat_shard_optimizer.py) instead of one tensor per parameter:
fewer, larger kernels, and optimizer state of exactly (padded) Ψ/N elements per state tensor, the
ZeRO paper's K·Ψ/N, with one Adam step counter per unit (the ledger tests count these bytes).

Param groups may hold the model's parameters as FSDP shows them (model.named_parameters(): local
parts under the original names) or the ORIGINAL Parameters of the plain model, collected before
wrapping, as nanoGPT's configure_optimizers does and DeepSpeed's initialize(model_parameters=)
accepts: each maps to the local part that took its name. A parameter in no group is not stepped.
Persistent (whole) parameters are stepped whole on every rank, the same on each (their gradients
are all-reduced). A step needs no communication: the gradients are already reduced, and the
next forward gathers the updated shards.

offload=OffloadSpec(...) (zero/tiers.py): ZeRO-Offload / ZeRO-Infinity. The tier (host or files)
holds every unit's fp32 master, gradient and optimizer state and runs the step; FSDP sends each
unit's reduced gradient down during backward (FSDP.offload), and with OffloadSpec.params
"cpu"/"nvme" the shards themselves live off the device between all-gathers. With the cpu tier and a
16-bit compute_dtype the device keeps only the 16-bit shard (2·Ψ/N bytes) and the fp32 master lives
on the host alone, as in DeepSpeed; the disk tier and fp32 training keep fp32 shards on the device
(the disk tier reads its masters from them).
"""
from __future__ import annotations

import torch

from minizero.zero.flat_shard_optimizer import FlatShardOptimizer
from minizero.zero.offload import HostOptimizer
from minizero.zero.tiers import ShardSource, build_tier


def _map_groups(fsdp, params):
    """Param groups (or tensors) with every tensor replaced by fsdp.local_parameter(tensor)."""
    if params is None:
        return [{"params": list(fsdp.parameters())}]
    groups = list(params)
    if groups and isinstance(groups[0], dict):
        return [
            {
                **g,
                "params": [
                    fsdp.local_parameter(p)
                    for p in (
                        [g["params"]] if isinstance(g["params"], torch.Tensor) else g["params"]
                    )
                ],
            }
            for g in groups
        ]
    return [{"params": [fsdp.local_parameter(p) for p in groups]}]


class FSDPOptimizer(FlatShardOptimizer):
    """`optimizer_cls` on the fp32 shards of an FSDP model (ZeRO-3), torch's optimizer interface."""

    def __init__(self, fsdp, optimizer_cls, params=None, offload=None, **optimizer_kwargs):
        super().__init__(_map_groups(fsdp, params), optimizer_cls, optimizer_kwargs)
        self.fsdp = fsdp        # the model whose shards this steps
        self.comm = fsdp.comm   # its ranks (for the state dict's layout)
        index = {id(p): i for i, p in enumerate(self.params)}
        masters = []
        for unit in fsdp.units:
            for part, master in (("shard", unit.shard), ("whole", unit.whole)):
                if master is None:
                    continue
                pieces = [(index[id(unit.visible[j])], lo, lo + numel, offset)
                          for j, offset, numel, lo in unit.slots[part]
                          if numel and id(unit.visible[j]) in index]
                # the rank's elements, then padding
                data_end = sum(numel for _, _, numel, _ in unit.slots[part])
                masters.append((master, pieces, data_end, part == "whole"))
        self.parts = [(unit, part) for unit in fsdp.units for part in ("shard", "whole")
                      if getattr(unit, part) is not None]  # masters[i] is parts[i]'s tensor
        # where the state (and, with offload.params, the shards) live; None: the device
        self.offload = offload
        self.tier = None if offload is None else self._offload(offload,
                                                               [m for m, _, _, _ in masters])
        self._build_runs(masters, self.tier)

    def _offload(self, spec, tensors):
        """The tier that steps every unit part off the device; FSDP sends each unit's gradient to
        it."""
        tier = build_tier(spec, tensors, self.optimizer_cls, self.comm.rank,
                          **self.optimizer_kwargs)
        # the shards' storage is now in files: the local parts follow
        if getattr(tier, "param_dir", None) is not None:
            self.fsdp.point_local_parts_at_shards()
        index = {(id(unit), part): i for i, (unit, part) in enumerate(self.parts)}
        sixteen = (
            isinstance(tier, HostOptimizer)
            and spec.params == "none"
            and self.fsdp.compute_dtype is not None
        )
        masters = (lambda unit,
                   part: tier.masters[index[(id(unit), part)]] if getattr(unit, part) is not None
                   else None) if sixteen else None
        # first (a model that cannot offload, HybridShard,
        # refuses here with nothing changed), then the layout
        self.fsdp.offload(
            lambda unit, part, grad: tier.accumulate(index[(id(unit), part)], grad),
            ShardSource(tier, self.fsdp.comm.device) if spec.params != "none" else None,
            masters,
        )
        if sixteen:
            self._keep_16bit_shards()
        return tier

    @torch.no_grad()
    def _keep_16bit_shards(self):
        """ZeRO-Offload's layout at stage 3 (as DeepSpeed's): the device keeps each unit's shard in
        the 16-bit compute dtype (2·Ψ/N bytes) and the tier, which just copied the fp32 shards,
        holds the only fp32 master on the host. The parameters come up in 16 bits after each step
        (2·Ψ/N bytes)."""
        for unit, part in self.parts:
            shard = getattr(unit, part)
            shard.data = shard.data.to(self.fsdp.dtype)
        self.fsdp.point_local_parts_at_shards()

    def grads(self) -> list:
        """Per master (unit part): its flat fp32 gradient, or None when it has none."""
        return [self.fsdp.unit_grad(unit, part) for unit, part in self.parts]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.tier is not None:  # the gradients went down during backward
            self.tier.step()
            return loss
        for master, grad in zip(self.masters, self.grads()):
            master.grad = grad
        try:
            self.step_masters({i for i, p in enumerate(self.params) if p.grad is not None})
        finally:
            for master in self.masters:
                master.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self.tier is not None:
            self.tier.zero_grad()
        for p in self.params:
            if set_to_none:
                p.grad = None  # the last view of a unit's flat gradient gone: the buffer is freed
            elif p.grad is not None:
                p.grad.zero_()

    def memory_tensors(self):
        """The optimizer state only; the shards and their gradients are the model's
        (FSDP.memory_tensors). Offloaded: the tier's masters, gradients and state where they live,
        and with offload.params "cpu" the shards on the host (measure the optimizer before the
        model, so these locations win)."""
        if self.tier is None:
            yield from self.optimizer_state_tensors()
            return
        yield from self.tier.memory_tensors()
        if self.offload.params == "cpu":  # "nvme": the disk tier reports the parameter files
            for master in self.masters:
                yield "parameters", master, "host"

    def __repr__(self):
        return (f"FSDPOptimizer({self.optimizer_cls.__name__}, rank "
                f"{self.comm.rank}/{self.comm.size}, {len(self.runs)} runs over "
                f"{len(self.masters)} shards, {len(self.param_groups)} groups)")
