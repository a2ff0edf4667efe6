# Lab 10: Tensor parallelism: f/g, column- and row-parallel linear
# GENERATED from minizero/tensor/layers.py by `make labs`. Edit nothing: this is the reference solution.
#   run:   mpirun -n 4 python solutions/lab10_tensor_parallel.py
#   check: python -m minizero_course grade --lab 10 --impl solutions    (or: pytest -m lab10 --impl solutions)
"""Megatron's tensor-parallel linear layers: the f and g operators, column- and row-parallel.

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism", Sec. 3. A linear layer Y = X A (torch stores W = A^T, out x in) splits
across the t ranks of a tensor-parallel group in two ways:

  column-parallel: A = [A_1 ... A_t] by output features (rows of W). Rank i computes its own
      slice of the output, Y_i = X A_i. X must be whole on every rank.
  row-parallel:    A = [A_1; ...; A_t] by input features (columns of W). With X = [X_1 ... X_t]
      split the same way, rank i computes a partial sum and Y = sum_i X_i A_i.

Column then row needs nothing in between: GeLU(X A_i) is exactly the X_i that the row-parallel
layer wants (GeLU is elementwise). So a transformer MLP is

    X --f--> X A_i --GeLU--> Y_i B_i --g--> Z = sum_i Y_i B_i

with two conjugate operators (Megatron's Fig. 3):
  f: identity in forward; in backward, all-reduce (sum) of the input gradient. Each rank's
     slice gives only its share dL/dY_i A_i^T of dL/dX.
  g: all-reduce (sum) in forward; identity in backward (dL/dZ is the same on every rank).

Attention is the same pattern with the heads split: the fused q|k|v layer is column-parallel
(each rank gets the q, k and v columns of ITS heads, `chunks=3`) and the output projection is
row-parallel. So a transformer layer costs 2 all-reduces in forward (g) and 2 in backward (f),
each of b*s*h activation elements; bytes sent per rank (ring, minizero.comm.stats):
    per layer per pass: 2 * 2(t-1)/t * b*s*h * bytes_per_element.
Weights and weight gradients never travel: each rank owns its slices.

A row-parallel bias is added ONCE, after g (added on every rank before the sum, it would count
t times). A column-parallel bias is sliced with the output features.

`sequence_parallel=True` (Korthikanti et al. 2022, minizero/tensor/sequence.py) replaces f by an
all-gather along the sequence and g by a reduce-scatter: the input of a column-parallel layer and
the output of a row-parallel layer are then sequence shards [b, s/t, h].

Every sharded parameter carries `tensor_parallel_dim` and `tensor_parallel_chunks`, so
`unshard` can put the full tensor back together (TensorParallelGPT.gather_full, in
minizero/tensor/parallel_gpt.py, gathers with it).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minizero.tensor.sequence import (
    linear_with_sequence_gather,
    reduce_scatter_to_sequence_parallel,
)


def check_divisible(what: str, size: int, tp_size: int):
    """A clear error before anything is built: TP splits `size` into tp_size equal slices."""
    if size % tp_size:
        raise ValueError(f"{what}={size} is not divisible by the tensor-parallel size {tp_size}: "
                         f"each of the {tp_size} ranks must own an equal slice. Choose a size that "
                         f"is a multiple of {tp_size}, or another tensor-parallel size")


# ------------------------------------------------------------------------------ f and g
class CopyToTensorParallel(torch.autograd.Function):
    """f: identity in forward, all-reduce (sum) of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        # f's forward.
        #   Y_i = X A_i needs the whole X on every rank of the tp group, and each rank already
        #   holds it (Megatron Fig. 3: f and g are conjugate). What does f have to send?
        return x

    @staticmethod
    def backward(ctx, grad):
        # f's backward.
        #   dL/dX = sum_i dL/dY_i A_i^T: rank i holds only its own term, and every rank needs
        #   the sum, over the tp group f was given (ctx.comm), never the world. It travels in
        #   the gradient's dtype: 2(t-1)/t * numel * element_size bytes per rank (a bf16
        #   gradient reduced in fp32 would send twice that). Don't modify autograd's tensor.
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, op="sum")
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce (sum) in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, comm):
        # g's forward.
        #   Z = sum_i Y_i B_i: each rank of the tp group `comm` holds one partial product and
        #   every rank needs the whole sum (the next layer wants all of Z). Same byte formula as
        #   f's backward, in x's dtype: the result keeps x's dtype. The input stays untouched
        #   (autograd may have saved it).
        out = x.contiguous().clone()
        comm.all_reduce(out, op="sum")
        return out

    @staticmethod
    def backward(ctx, grad):
        # g's backward.
        #   dZ/dY_i B_i is the identity for every i, and dL/dZ is already whole and the same on
        #   every rank: what does each rank's partial product get, and what must be sent?
        return grad, None


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dim in forward, keep this rank's slice in backward: turns a
    column-parallel output back into the full one (`gather_output=True`; tests and demos)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        x = x.contiguous()
        out = torch.empty((comm.size, *x.shape), dtype=x.dtype, device=x.device)
        comm.all_gather(out, x)
        return torch.cat(out.unbind(0), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.comm.size, dim=-1)[ctx.comm.rank].contiguous(), None


def copy_to_tensor_parallel(x, comm):
    return CopyToTensorParallel.apply(x, comm)


def reduce_from_tensor_parallel(x, comm):
    return ReduceFromTensorParallel.apply(x, comm)


def gather_from_tensor_parallel(x, comm):
    return GatherFromTensorParallel.apply(x, comm)


# ------------------------------------------------------------------------------ slices
def shard(full: torch.Tensor, dim: int, rank: int, size: int, chunks: int = 1) -> torch.Tensor:
    """Rank `rank`'s slice (of `size`) of `full` along `dim`. With chunks > 1 the tensor is
    `chunks` blocks along `dim` (c_attn's [q | k | v]) and the rank takes its slice of each block,
    concatenated: [q_rank | k_rank | v_rank], whole heads of each."""
    # shard, this rank's slice of each block.
    #   Invariant: unshard([shard(full, dim, r, size, chunks) for r in range(size)], dim, chunks)
    #   == full. A fused [q | k | v] weight (chunks=3) is three matrices stacked along dim: each
    #   rank must get whole heads of q, of k AND of v (its size-th of each block), or attention
    #   on that rank would mix one head's queries with another's keys.
    blocks = full.chunk(chunks, dim)
    width = blocks[0].size(dim) // size
    return torch.cat([block.narrow(dim, rank * width, width) for block in blocks], dim)


def unshard(shards: list[torch.Tensor], dim: int, chunks: int = 1) -> torch.Tensor:
    """The inverse of `shard`: the full tensor from every rank's slice, in rank order."""
    pieces = [s.chunk(chunks, dim) for s in shards]
    return torch.cat([pieces[r][c] for c in range(chunks) for r in range(len(shards))], dim)


def mark_sharded(param: nn.Parameter, dim: int, chunks: int = 1) -> nn.Parameter:
    param.tensor_parallel_dim = dim  # the full tensor = unshard(every rank's slice, dim, chunks)
    param.tensor_parallel_chunks = chunks
    return param


# ------------------------------------------------------------------------------ the layers
class ParallelLinear(nn.Module):
    """What the two layers share: built from a full nn.Linear, or initialized like one."""

    def reset_parameters(self):
        """nn.Linear's init of the FULL matrix from the global RNG, then this rank's slice
        (Megatron's CPU initialization): with the same seed on every rank, the layer IS the
        single-process one."""
        full = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        self.load_full(full.weight, full.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm, **kwargs):
        """This rank's slices of `linear`'s weights (same dtype); keyword arguments as the
        constructor's."""
        # the init is overwritten: leave the caller's RNG alone
        with torch.random.fork_rng(devices=[]):
            layer = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,
                        dtype=linear.weight.dtype, **kwargs)
        layer.load_full(linear.weight, linear.bias)
        return layer


class ColumnParallelLinear(ParallelLinear):
    """y_i = x W_i^T + b_i: this rank's `out_features / t` output features (rows of W).

    Input: the whole x (or its sequence shard [b, s/t, h] with sequence_parallel, all-gathered
    here). Output: this rank's slice [..., out_features / t], or everything with gather_output.
    `chunks` says how the FULL weight is laid out for `load_full`: 3 for a fused q|k|v layer."""

    def __init__(self, in_features: int, out_features: int, comm, bias: bool = True,
                 chunks: int = 1, gather_output: bool = False, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if out_features % chunks:
            raise ValueError(f"out_features={out_features} is not {chunks} equal blocks "
                             f"(chunks={chunks})")
        check_divisible("out_features" if chunks == 1 else f"out_features / {chunks} (one block of "
                                                           "the fused layer)",
                        out_features // chunks, comm.size)
        self.comm = comm                           # the tensor-parallel group (mesh.tp)
        self.in_features = in_features             # full input width: x is whole on every rank
        self.out_features = out_features           # full output width, before the split
        self.chunks = chunks  # blocks of the full weight split separately (q|k|v: 3)
        # all-gather the output slices (not for a following row layer)
        self.gather_output = gather_output
        # input is a sequence shard: all-gather it instead of f
        self.sequence_parallel = sequence_parallel
        local, kw = out_features // comm.size, {"device": comm.device, "dtype": dtype}
        self.weight = mark_sharded(nn.Parameter(torch.empty(local, in_features, **kw)), 0, chunks)
        self.bias = (
            mark_sharded(nn.Parameter(torch.empty(local, **kw)), 0, chunks) if bias else None
        )
        self.reset_parameters()

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """Copy this rank's slice of a full (out_features x in_features) weight and its bias."""
        # rows: output features, dim 0, in self.chunks blocks
        rank, size = self.comm.rank, self.comm.size
        self.weight.copy_(shard(weight, 0, rank, size, self.chunks))
        if self.bias is not None:
            self.bias.copy_(shard(bias, 0, rank, size, self.chunks))

    def forward(self, x):
        if not self.sequence_parallel:
            # ColumnParallelLinear.forward.
            #   y = this rank's output features, X A_i + b_i: x is whole on every rank, and in
            #   backward the partial dL/dx of the t ranks must be summed: which operator gives
            #   both, over this layer's tp group (self.comm)?
            y = F.linear(copy_to_tensor_parallel(x, self.comm), self.weight, self.bias)
        else:
            # sequence parallelism, the column side (stretch task, extra points).
            #   Korthikanti et al. 2022, Sec. 4: x is this rank's sequence shard [b, s/t, h] (the
            #   LayerNorm before ran on s/t tokens). The matmul needs every token, and backward
            #   must hand each rank the sum of dL/dx for ITS tokens only: f becomes f_bar, the
            #   conjugate pair of an all-gather along the sequence and a reduce-scatter, (t-1)/t
            #   * b*s*h elements each, so a layer sends what TP's all-reduces sent. Keeping only
            #   the shard for backward is what saves the memory (minizero/tensor/sequence.py).
            y = linear_with_sequence_gather(x, self.weight, self.bias, self.comm)
        return gather_from_tensor_parallel(y, self.comm) if self.gather_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features // self.comm.size} here, t={self.comm.size}), "
                f"chunks={self.chunks}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(ParallelLinear):
    """y = sum_i x_i W_i^T + b: this rank's `in_features / t` input features (columns of W).

    Input: this rank's slice [..., in_features / t] (a column-parallel layer's output). Output:
    the full y on every rank after g, or its sequence shard [b, s/t, h] (reduce-scatter) with
    sequence_parallel. The bias is whole on every rank and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, comm, bias: bool = True,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        check_divisible("in_features", in_features, comm.size)
        self.comm = comm                           # the tensor-parallel group (mesh.tp)
        self.in_features = in_features             # full input width, before the split
        self.out_features = out_features           # full output width: y is whole after the sum
        # reduce-scatter the output along the sequence instead of g
        self.sequence_parallel = sequence_parallel
        local, kw = in_features // comm.size, {"device": comm.device, "dtype": dtype}
        self.weight = mark_sharded(nn.Parameter(torch.empty(out_features, local, **kw)), 1)
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """Copy this rank's columns of a full (out_features x in_features) weight, and the whole
        bias."""
        # columns: input features, dim 1
        self.weight.copy_(shard(weight, 1, self.comm.rank, self.comm.size))
        if self.bias is not None:
            self.bias.copy_(bias)  # not split: added once, after the sum

    def forward(self, x):
        if not self.sequence_parallel:
            # RowParallelLinear.forward.
            #   y = sum_i x_i A_i over the tp group (self.comm), the bias not included: it is
            #   added below, once (added on each of the t ranks before the sum, it would count
            #   t times).
            y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)
        else:
            # sequence parallelism, the row side (stretch task, extra points).
            #   The sum of the partial products is needed only by the next LayerNorm and the
            #   residual, which now work on s/t tokens: g becomes g_bar, the sum AND the split
            #   along the sequence (each rank keeps [b, s/t, h] of it), its backward the all-
            #   gather of the gradient. A ring all-reduce is exactly this reduce-scatter plus an
            #   all-gather, so the bytes stay TP's. The bias (below) is added once per token.
            y = reduce_scatter_to_sequence_parallel(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return (f"in_features={self.in_features} ({self.in_features // self.comm.size} here, "
                f"t={self.comm.size}), out_features={self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}")


def split_numel(module: nn.Module) -> tuple[int, int]:
    """(sharded, replicated) parameter elements of `module` on this rank: the ledger's parameter
    bytes are (sharded + replicated) * bytes, and the single-process model's are (t * sharded +
    replicated)."""
    sharded = sum(p.numel() for p in module.parameters() if hasattr(p, "tensor_parallel_dim"))
    return sharded, sum(p.numel() for p in module.parameters()) - sharded


__all__ = ["ParallelLinear", "ColumnParallelLinear", "RowParallelLinear", "CopyToTensorParallel",
           "ReduceFromTensorParallel",
           "GatherFromTensorParallel", "copy_to_tensor_parallel", "reduce_from_tensor_parallel",
           "gather_from_tensor_parallel", "shard", "unshard", "mark_sharded", "check_divisible",
           "split_numel"]


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(10, globals())
