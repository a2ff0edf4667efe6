"""Sequence parallelism: the LayerNorm and residual activations split along the sequence too.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.
Tensor parallelism (layers.py) splits the matmuls, but leaves the LayerNorms, the residual adds and
the dropouts working on the whole [b, s, h] activation on every rank. Per layer, per rank, with
16-bit activations and 1-byte dropout masks (their Eq. 2 and Sec. 4.2.2):
    TP:        s*b*h * (10 + 24/t + 5*a*s/(h*t))   bytes
    TP + SP:   s*b*h/t * (34 + 5*a*s/h)            bytes      (everything divided by t)
Those ops act on each token alone, so each rank can run them on s/t of the tokens. The f/g pair
of layers.py becomes the pair
    g -> g_bar: reduce-scatter along the sequence in forward (each rank keeps s/t tokens of the
                sum), all-gather in backward;
    f -> f_bar: all-gather along the sequence in forward, reduce-scatter in backward.
A ring all-reduce IS a reduce-scatter followed by an all-gather, so the bytes do not change: per
layer and pass, 2 reduce-scatters + 2 all-gathers of b*s*h elements, (t-1)/t * b*s*h * bytes
each, the same 2 * 2(t-1)/t * b*s*h * bytes as TP's two all-reduces.

The column-parallel layer keeps only its input SHARD for backward and all-gathers it again there
(Megatron does the same, overlapping it with the input-gradient matmul): backward then runs one
more all-gather per column-parallel layer, 4 all-gathers + 2 reduce-scatters per layer. That
extra all-gather is what buys storing s*b*h/t instead of s*b*h.

Parameters that now see only s/t of the tokens get PARTIAL gradients: the LayerNorms, the row-
parallel biases (added after the reduce-scatter) and the position embedding. Megatron all-reduces
them over the tensor-parallel group after backward (`_allreduce_layernorm_grads`). Here a hook on
each such parameter all-reduces its gradient as autograd produces it, before it is accumulated:
the same sum, and it composes with gradient accumulation and with the hooks of any data-parallel
wrapper (DDP, ZeRO-2/3 run theirs after it) or pipeline stage, with no call to forget. Cost: one
small all-reduce (the parameter's size) per marked parameter per backward.

Activations here are batch-first, [b, s, h] (nanoGPT), not Megatron's [s, b, h]: sequence shards
are SEQUENCE_DIM slices, so the collectives work on a transposed contiguous copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SEQUENCE_DIM = 1  # [batch, sequence, hidden]


def check_sequence(seq_len: int, tp_size: int):
    """Sequence parallelism splits the tokens into tp_size equal shards."""
    if seq_len % tp_size:
        raise ValueError(f"sequence parallelism: sequence length {seq_len} is not divisible by the "
                         f"tensor-parallel size {tp_size}. Use sequences whose length is a "
                         f"multiple of {tp_size}, or sequence_parallel=False")


def all_gather_sequence(shard: torch.Tensor, comm) -> torch.Tensor:
    """[b, s/t, ...] on each rank -> [b, s, ...], rank r's tokens at r*s/t ... (r+1)*s/t."""
    seq_first = shard.transpose(0, SEQUENCE_DIM).contiguous()
    out = torch.empty((comm.size * seq_first.size(0), *seq_first.shape[1:]), dtype=shard.dtype,
                      device=shard.device)
    comm.all_gather(out, seq_first)
    return out.transpose(0, SEQUENCE_DIM)


def reduce_scatter_sequence(full: torch.Tensor, comm) -> torch.Tensor:
    """[b, s, ...] partial sums on each rank -> this rank's s/t tokens of the sum, [b, s/t, ...]."""
    check_sequence(full.size(SEQUENCE_DIM), comm.size)
    seq_first = full.transpose(0, SEQUENCE_DIM).contiguous()
    out = torch.empty((seq_first.size(0) // comm.size, *seq_first.shape[1:]), dtype=full.dtype,
                      device=full.device)
    comm.reduce_scatter(out, seq_first, op="sum")
    return out.transpose(0, SEQUENCE_DIM)


def sequence_shard(full: torch.Tensor, comm) -> torch.Tensor:
    """This rank's s/t tokens of a tensor every rank holds whole (no communication)."""
    check_sequence(full.size(SEQUENCE_DIM), comm.size)
    return full.chunk(comm.size, SEQUENCE_DIM)[comm.rank]


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """g_bar: reduce-scatter along the sequence in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return reduce_scatter_sequence(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.comm), None


class LinearWithSequenceGather(torch.autograd.Function):
    """f_bar fused with the column-parallel matmul: y = all_gather(x_shard) W^T + b.

    Saves x_shard, not the gathered x. Backward all-gathers it again (async, while the input
    gradient is computed), reduce-scatters the input gradient (async, while the weight gradient
    is computed): Megatron's LinearWithGradAccumulationAndAsyncCommunication."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, comm):
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x_shard, weight)
        return F.linear(all_gather_sequence(x_shard, comm), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_shard, weight = ctx.saved_tensors
        comm = ctx.comm
        seq_first = x_shard.transpose(0, SEQUENCE_DIM).contiguous()
        gathered = torch.empty((comm.size * seq_first.size(0), *seq_first.shape[1:]),
                               dtype=x_shard.dtype, device=x_shard.device)
        gather = comm.all_gather(gathered, seq_first, async_op=True)
        grad_in = (grad_out @ weight).transpose(0, SEQUENCE_DIM).contiguous()  # [s, b, in]
        grad_shard = torch.empty((grad_in.size(0) // comm.size, *grad_in.shape[1:]),
                                 dtype=grad_in.dtype, device=grad_in.device)
        gather.wait()
        scatter = comm.reduce_scatter(grad_shard, grad_in, op="sum", async_op=True)
        x_full = gathered.transpose(0, SEQUENCE_DIM)
        grad_2d = grad_out.reshape(-1, grad_out.size(-1))
        grad_weight = grad_2d.t() @ x_full.reshape(-1, x_full.size(-1))
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        scatter.wait()
        return grad_shard.transpose(0, SEQUENCE_DIM), grad_weight, grad_bias, None


def reduce_scatter_to_sequence_parallel(x, comm):
    return ReduceScatterToSequenceParallel.apply(x, comm)


def linear_with_sequence_gather(x_shard, weight, bias, comm):
    return LinearWithSequenceGather.apply(x_shard, weight, bias, comm)


def mark_sequence_parallel(param: torch.nn.Parameter, comm):
    """`param` sees s/t of the tokens: all-reduce (sum) its gradient over the tp group as autograd
    produces it. Returns the hook handle."""
    if getattr(param, "sequence_parallel", False):
        return None  # already marked (a tied parameter met twice): one reduction
    param.sequence_parallel = True

    def all_reduce_grad(grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, op="sum")
        return grad
    return param.register_hook(all_reduce_grad)
