"""`deepspeed.zero.GatheredParameters(params, modifier_rank=None)`: the parameters whole inside the
block.

In DeepSpeed the context gathers ZeRO-3 partitioned parameters and, when modifier_rank is given,
broadcasts that rank's changes on exit; for parameters that are not partitioned it does nothing.
minizero's FSDP keeps a model's parameters in its flat shards and exposes them whole only inside
forward, so a model wrapped by FSDP (or built under zero.Init and not yet materialized) is refused
with what to use instead (FSDP.gather_full_params, or the engine's checkpoint and
`minizero consolidate`). Plain parameters (ZeRO stages 0-2, or a model before minizero.initialize)
are whole already: with modifier_rank, the rank's changes are broadcast to every rank on exit, as
DeepSpeed does, so an initialization written on rank 0 reaches all.
"""
from __future__ import annotations

import torch

from minizero import comm as comm_mod


class GatheredParameters:
    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if p is not None] if enabled else []
        self.modifier_rank = modifier_rank
        # FSDP's local part of a parameter carries the whole one's full_shape
        hidden = [
            p
            for p in self.params
            if p.is_meta or tuple(p.shape) != tuple(getattr(p, "full_shape", p.shape))
        ]
        if hidden:
            raise ValueError(f"zero.GatheredParameters: {len(hidden)} of the parameters are "
                             "sharded by minizero's ZeRO-3 (FSDP) or still on the meta device "
                             "(zero.Init): minizero gathers them only inside forward. Read them "
                             "whole with FSDP.gather_full_params() (a collective), or save a "
                             "checkpoint and run `python -m minizero consolidate`")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if (
            exc[0] is None
            and self.modifier_rank is not None
            and self.params
            and comm_mod.is_initialized()
        ):
            world = comm_mod.get()
            if world.size > 1:
                with torch.no_grad():
                    world.broadcast_tensors([p.data for p in self.params], src=self.modifier_rank)
        return False
