"""Per-parameter dim-0 shards: FSDP2's layout, as an alternative to FlatLayout's one flat cut.

torch's fully_shard (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
FSDPParam._init_sharded_param) cuts EVERY parameter on dim 0 into N chunks of ceil(dim0 / N) rows
(torch.chunk): rank r holds rows [r·c, min((r+1)·c, dim0)), and the last ranks' chunks are padded
with zero rows to c rows, so every rank's piece of a parameter has the same size. FlatLayout instead
cuts one flat buffer wherever the shard boundary falls: a 64-element norm weight may be 64 elements
on rank 0 and none on rank 1, and code that all-gathers each parameter's piece (FSDP2's idiom) then
waits for pieces that never come.

A rank's shard here is its chunks end to end, [p0 chunk r | p1 chunk r | ...], shard_numel =
Σ_i c_i·row_i elements (row_i: elements per row of p_i), the same on every rank. The all-gather's
output is therefore rank-major, [rank 0's shard | rank 1's | ...] (FSDP2's foreach_all_gather
output), and the compute order, where each parameter is contiguous, is param-major: p_i's N chunks
back to back, its first numel_i elements the full parameter, then its padding rows (FSDP2's copy-out
into unsharded parameters). to_compute / to_comm convert between the two (one copy each way; FSDP2
pays the same copies: foreach_all_gather_copy_out, and chunk_cat before its reduce-scatter).

Padding is real memory and real traffic: padded_numel = N · shard_numel elements are gathered and
reduce-scattered, so each rank sends (N-1) · shard_numel · bytes per element in each, and holds
shard_numel elements of parameters (and of gradient).
"""
from __future__ import annotations

import math

import torch

from minizero.zero.flat_layout import Piece


class PerParamLayout:
    """Same interface as FlatLayout (numel, shard_numel, padded_numel, padding, shard, flatten,
    pieces), plus the conversions between the all-gather's rank-major order and the parameters'
    order."""

    reorders = True  # the all-gather's order is not the parameters'

    def __init__(self, shapes, world_size: int):
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.world_size = world_size
        # a 0-dim tensor: one row of one element
        self.dim0 = [s[0] if len(s) else 1 for s in self.shapes]
        self.row_numels = [n // d if d else 0 for n, d in zip(self.numels, self.dim0)]
        self.rows = [-(-d // world_size) for d in self.dim0]  # c_i = ceil(dim0 / N) rows per rank
        self.chunk_numels = [c * r for c, r in zip(self.rows, self.row_numels)]
        self.shard_offsets = [0]  # where p_i's chunk starts in a shard
        for n in self.chunk_numels:
            self.shard_offsets.append(self.shard_offsets[-1] + n)
        self.numel = sum(self.numels)  # Ψ for this group of tensors
        self.shard_numel = self.shard_offsets[-1]                            # Σ c_i · row_i
        self.padded_numel = self.shard_numel * world_size  # what one all-gather moves
        # p_i's start in compute order
        self.offsets = [world_size * a for a in self.shard_offsets[:-1]]

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def local_rows(self, index: int, rank: int) -> tuple[int, int]:
        """Rows [lo, hi) of tensor `index` that rank holds (hi == lo: none, only padding)."""
        c, d = self.rows[index], self.dim0[index]
        return min(rank * c, d), min((rank + 1) * c, d)

    def local_shape(self, index: int, rank: int) -> torch.Size:
        """The shape of rank's piece, padding excluded (FSDP2's sharded_param.to_local().shape)."""
        lo, hi = self.local_rows(index, rank)
        shape = self.shapes[index]
        return torch.Size([hi - lo, *shape[1:]]) if len(shape) else torch.Size([hi - lo])

    def pieces(self, rank: int) -> list[Piece]:
        """The rows each tensor has on rank, as flat element ranges (rows are contiguous on dim
        0)."""
        out = []
        for i, row in enumerate(self.row_numels):
            lo, hi = self.local_rows(i, rank)
            if hi > lo:
                out.append(Piece(i, lo * row, hi * row, self.shard_offsets[i]))
        return out

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's shard of a rank-major flat buffer (flatten's output, or an all-gather's)."""
        return flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]

    def flatten(self, tensors, dtype=None, device=None) -> torch.Tensor:
        """A new rank-major padded flat buffer of `tensors` (padding is zero): what the all-gather
        returns."""
        tensors = list(tensors)
        dtype = dtype or tensors[0].dtype
        device = device or tensors[0].device
        compute = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for t, a, n in zip(tensors, self.offsets, self.numels):
            compute[a:a + n].copy_(t.detach().reshape(-1))
        return self.to_comm(compute)

    def compute_sizes(self) -> list[tuple[int, bool]]:
        """The compute-order buffer as (size, is a tensor) segments: each tensor, then its padding
        rows."""
        return [seg for n, c in zip(self.numels, self.chunk_numels)
                for seg in ((n, True), (self.world_size * c - n, False))]

    def to_compute(self, flat: torch.Tensor) -> torch.Tensor:
        """Rank-major (as gathered) -> param-major (each tensor contiguous, then its padding). A new
        tensor."""
        by_rank = flat.view(self.world_size, self.shard_numel)
        return torch.cat([by_rank[:, a:b].reshape(-1) for a,
                          b in zip(self.shard_offsets, self.shard_offsets[1:])])

    def to_comm(self, flat: torch.Tensor) -> torch.Tensor:
        """Param-major -> rank-major (what reduce-scatter cuts in N). A new tensor."""
        chunks = [v.view(self.world_size, c) for v, c in
                  zip(flat.split([self.world_size * c for c in self.chunk_numels]),
                      self.chunk_numels)]
        return torch.cat(chunks, dim=1).reshape(-1) if chunks else flat.clone()
