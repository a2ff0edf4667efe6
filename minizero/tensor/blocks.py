"""Parallel transformer blocks: attention with the heads split, MLP column-then-row, and the
sequence-parallel LayerNorms. Converts a block IN PLACE, by its module structure.

The names are nanoGPT's and Megatron's (minizero.models.Block; nothing here imports it):
    block.ln_1, block.attn.c_attn, block.attn.c_proj, block.ln_2, block.mlp.c_fc, block.mlp.c_proj
Each Linear is replaced by its parallel layer holding this rank's slices of the same weights, and
the attention and MLP modules keep their own forward:
  * attention (Shoeybi et al. 2019, Sec. 3, Fig. 3b): c_attn -> ColumnParallelLinear(chunks=3),
    so rank r gets the q, k and v columns of heads [r*a/t, (r+1)*a/t); c_proj -> RowParallelLinear.
    The attention code takes the head count and the sequence length from c_attn's OUTPUT, so it
    runs unchanged on its a/t local heads (and on the all-gathered sequence with SP). Heads never
    talk to each other, which is why attention splits with no communication inside.
  * MLP (Fig. 3a): c_fc -> ColumnParallelLinear, c_proj -> RowParallelLinear.
So a block runs f before c_attn and c_fc, g after each c_proj: 2 all-reduces of b*s*h elements in
forward, 2 in backward.
  * sequence parallelism (Korthikanti et al. 2022): the block's input and output are sequence
    shards [b, s/t, h]; the LayerNorms and residual adds run on s/t tokens; f/g become all-gather /
    reduce-scatter (sequence.py). Every replicated parameter of the block (LayerNorm weights and
    biases, the row-parallel biases) then sees only its shard's tokens: its gradient is all-reduced
    over the tp group (sequence.mark_sequence_parallel), as Megatron's _allreduce_layernorm_grads.

A pipeline stage of a 3D run (dp x pp x tp) converts just its own blocks with
`parallelize_block(block, mesh.tp)` and passes [b, s, h] (or [b, s/t, h] with SP) activations
between stages.
"""
from __future__ import annotations

import torch.nn as nn

from minizero.tensor.layers import (
    ColumnParallelLinear,
    ParallelLinear,
    RowParallelLinear,
    check_divisible,
)
from minizero.tensor.sequence import mark_sequence_parallel


def check_block(block: nn.Module, tp_size: int, where: str = "block"):
    """Every size the split needs, checked before anything is changed."""
    attn, mlp = block.attn, block.mlp
    if any(isinstance(m, ParallelLinear) for m in (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)):
        raise ValueError(f"{where} is already tensor-parallel: convert the single-process model "
                         "once")
    n_head = attn.c_attn.out_features // 3 // attn.head_dim
    check_divisible(f"{where}: the number of attention heads n_head", n_head, tp_size)
    check_divisible(f"{where}: the MLP hidden size (mlp.c_fc.out_features)", mlp.c_fc.out_features,
                    tp_size)


def parallelize_attention(attn: nn.Module, comm, sequence_parallel: bool = False,
                          column_cls=ColumnParallelLinear, row_cls=RowParallelLinear) -> nn.Module:
    """Heads split over comm: c_attn column-parallel by [q | k | v] blocks, c_proj row-parallel."""
    attn.c_attn = column_cls.from_linear(attn.c_attn, comm, chunks=3,
                                         sequence_parallel=sequence_parallel)
    attn.c_proj = row_cls.from_linear(attn.c_proj, comm, sequence_parallel=sequence_parallel)
    return attn


def parallelize_mlp(mlp: nn.Module, comm, sequence_parallel: bool = False,
                    column_cls=ColumnParallelLinear, row_cls=RowParallelLinear) -> nn.Module:
    """c_fc column-parallel, c_proj row-parallel: one all-reduce (g) per pass, after c_proj."""
    mlp.c_fc = column_cls.from_linear(mlp.c_fc, comm, sequence_parallel=sequence_parallel)
    mlp.c_proj = row_cls.from_linear(mlp.c_proj, comm, sequence_parallel=sequence_parallel)
    return mlp


def mark_replicated_sequence_parallel(module: nn.Module, comm) -> list:
    """With SP: every parameter of `module` that is not split over the tp group sees s/t of the
    tokens, so its gradient is summed over the group. Returns the hook handles."""
    return [h for p in module.parameters() if not hasattr(p, "tensor_parallel_dim")
            for h in [mark_sequence_parallel(p, comm)] if h is not None]


def parallelize_block(block: nn.Module, comm, sequence_parallel: bool = False,
                      column_cls=ColumnParallelLinear, row_cls=RowParallelLinear) -> nn.Module:
    """Turn one transformer block into its comm.size-way tensor-parallel version, in place.
    `column_cls`/`row_cls` choose the linear layers (as Megatron's layer specs do): lab 10 passes
    the student's."""
    check_block(block, comm.size)
    parallelize_attention(block.attn, comm, sequence_parallel, column_cls, row_cls)
    parallelize_mlp(block.mlp, comm, sequence_parallel, column_cls, row_cls)
    if sequence_parallel:
        mark_replicated_sequence_parallel(block, comm)
    return block
