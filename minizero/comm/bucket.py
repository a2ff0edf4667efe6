"""minizero.comm.bucket: the gradient bucket DDP and ZeRO-2 share, and their accumulation switch.

A bucket is a contiguous range [lo, hi) of a flat gradient order and the parameters whose gradients
fill it. Both wrappers cut the order the same way (walking the parameters backwards, about the order
backward produces their gradients) and fill the same slots; they differ only in the collective:
DDP all-reduces the whole range into a buffer it keeps (the gradients live there), ZeRO-2 reduces
each part to the rank whose shard it falls in, from a buffer that lives until then. Megatron-LM
serves its DDP, distributed optimizer and experts from one bucket in the same way.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def group_params(
    numels: list[int], bucket_numel: int, dtypes: list | None = None
) -> list[list[int]]:
    """Indices into `numels`, walked backwards, cut into groups of about `bucket_numel` elements.

    A group closes when the next parameter would overflow it or (dtypes given) change dtype, since
    one flat buffer has one dtype. A parameter bigger than the cap gets a group of its own."""
    groups, current, numel = [], [], 0
    for i in reversed(range(len(numels))):
        if current and (
            numel + numels[i] > bucket_numel
            or (dtypes is not None and dtypes[i] != dtypes[current[0]])
        ):
            groups.append(current)
            current, numel = [], 0
        current.append(i)
        numel += numels[i]
    if current:
        groups.append(current)
    return groups


class Bucket:
    """A range [lo, hi) of a flat gradient order, its parameters' slots, and the reduction in flight
    on it."""

    def __init__(self, name: str, params: list, index: list[int], offsets: list[int], lo: int,
                 hi: int, shard_numel: int | None = None, world: int = 1):
        """params: the bucket's parameters in slot order; index[s]: params[s]'s position in its
        owner's parameter list; offsets[s]: where its slot starts in the flat order. shard_numel,
        world: the flat order is sharded over `world` ranks, shard_numel elements each (ZeRO-2),
        which sets `parts`."""
        self.name = name                     # its name in memory.transient
        self.params = params
        self.index = index
        self.slot = {i: s for s, i in enumerate(index)}  # owner's parameter index -> slot
        self.offsets = offsets
        self.lo, self.hi = lo, hi
        # (owner, a, b): the part [a, b) of this bucket that falls in rank owner's shard
        self.parts = [] if shard_numel is None else [
            (r, max(lo, r * shard_numel), min(hi, (r + 1) * shard_numel)) for r in range(world)
            if max(lo, r * shard_numel) < min(hi, (r + 1) * shard_numel)]
        self.buffer = None                   # allocate() keeps one; ZeRO-2 allocates per backward
        self.views = []                      # views[s]: params[s]'s slot, shaped like the parameter
        self.reset()

    def allocate(self, dtype, device):
        """A zeroed buffer for the whole range, and a view of every slot into it."""
        self.buffer = torch.zeros(self.hi - self.lo, dtype=dtype, device=device)
        self.views = [self.buffer[a - self.lo:a - self.lo + p.numel()].view_as(p)
                      for p, a in zip(self.params, self.offsets)]
        return self.buffer

    def reset(self):
        """Ready for the next backward: no slot filled, nothing in flight."""
        self.filled = [False] * len(self.params)
        self.had_grad = [False] * len(self.params)  # whether each slot got a local gradient
        self.works = []                               # the async reductions once launched

    def full(self) -> bool:
        return all(self.filled)


class SyncSwitch:
    """torch DDP's two ways to accumulate gradients locally: `with model.no_sync():` and
    `model.require_backward_grad_sync = False` (nanoGPT's idiom). Backwards while the switch is off
    only add into p.grad; the next one with it on reduces the sum, once. A wrapper sets self._sync =
    True."""

    @contextmanager
    def no_sync(self):
        """Backwards inside keep local gradients; the next one outside reduces the sum.
        Scale each micro-batch loss by 1/k yourself."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    @property
    def require_backward_grad_sync(self) -> bool:
        """False is no_sync() for the backwards that follow, until it is set True again."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool):
        self._sync = bool(value)
