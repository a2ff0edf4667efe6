"""Flat, padded buffers: how every ZeRO stage lays out many tensors as one and cuts it in N.

Collectives want one big contiguous buffer, not hundreds of small tensors, and sharding
wants that buffer to split into N equal pieces. So a `FlatLayout` packs tensors end to end,
pads the tail with zeros up to a multiple of N, and hands rank r the slice
[r * shard_numel, (r + 1) * shard_numel). The padding is real memory: the ledger counts it,
and the expected sharded bytes in the tests are padded_numel / N * element_size, not Ψ / N.

Tensors are cut wherever the shard boundary falls: a parameter may live partly on rank 0 and
partly on rank 1. Elementwise optimizers (SGD, Adam, AdamW) do not care, which is why ZeRO
can step a flat shard as if it were one big parameter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """The part of tensor `index` that falls in one shard: tensor[lo:hi] (flattened) is
    shard[shard_lo:shard_lo + hi - lo]."""
    index: int
    lo: int
    hi: int
    shard_lo: int


class FlatLayout:
    # the all-gather's order is the parameters' (zero/per_param_layout.py's is not)
    reorders = False

    def __init__(self, shapes, world_size: int):
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]                      # Ψ for this group of tensors
        self.world_size = world_size
        self.shard_numel = -(-self.numel // world_size)    # ceil(Ψ / N)
        self.padded_numel = self.shard_numel * world_size  # Ψ rounded up to a multiple of N

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def flatten(self, tensors, dtype=None, device=None) -> torch.Tensor:
        """A new padded flat buffer holding copies of `tensors` (padding is zero)."""
        tensors = list(tensors)
        dtype = dtype or tensors[0].dtype
        device = device or tensors[0].device
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for t, view in zip(tensors, self.views(flat)):
            view.copy_(t.detach())
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like the original tensors (writing them writes `flat`)."""
        return [flat[a:b].view(s) for a, b, s in zip(self.offsets, self.offsets[1:], self.shapes)]

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        a, b = self.shard_range(rank)
        return flat[a:b]

    def pieces(self, rank: int) -> list[Piece]:
        """Which parts of which tensors fall in rank's shard (for per-tensor bookkeeping such
        as gradient clipping or copying a single gradient into the shard)."""
        a, b = self.shard_range(rank)
        out = []
        for i, (start, end) in enumerate(zip(self.offsets, self.offsets[1:])):
            lo, hi = max(start, a), min(end, b)
            if lo < hi:
                out.append(Piece(i, lo - start, hi - start, lo - a))
        return out

    # the interface zero/per_param_layout.py also has: here the gathered order is the compute order
    def local_shape(self, index: int, rank: int) -> torch.Size:
        """Rank's piece of tensor `index`: the flat elements its shard holds (maybe none)."""
        return torch.Size([sum(pc.hi - pc.lo for pc in self.pieces(rank) if pc.index == index)])

    def compute_sizes(self) -> list[tuple[int, bool]]:
        """The gathered buffer as (size, is a tensor) segments: the tensors end to end, then the
        padding."""
        return [(n, True) for n in self.numels] + [(self.padding, False)]

    def to_compute(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def to_comm(self, flat: torch.Tensor) -> torch.Tensor:
        return flat
