"""Block-sparse attention in plain torch: only the kept blocks of the layout are ever computed.

The layout's kept blocks are listed once, (h, i, j) for every layout[h, i, j] (nnz of them); query
block i and key/value block j of head h are gathered for each, so the scores are [batch, nnz, block,
block] (DeepSpeed's block-sparse "sdd" product has this shape: deepspeed/ops/sparse_attention/
matmul.py), never [batch, heads, n, n]. The softmax runs over a query row's blocks, which sit at
different places in that list: its maximum and its sum are reduced per row (scatter_reduce,
index_add), and the row's output is the sum of its blocks' P_ij V_j. The backward is written out
(_BlockSparseAttention) so that only q, k, v, the output and P are kept, not the gathered blocks.

Per layer, with b the batch, nnz the kept blocks over all heads, B the block, d the head size:
    score bytes   b·nnz·B²·bytes_per     (dense: b·heads·n²·bytes_per; the probabilities kept for
                  backward)
    FLOPs         4·b·nnz·B²·d            (Q·Kᵀ and P·V, forward; dense 4·b·heads·n²·d)
Dense causal attention computes every score and masks half of them; a causal layout keeps only
blocks on or below the diagonal, so a dense layout (all nb(nb+1)/2 of them) costs about half the
dense FLOPs. Kept for backward besides P: q, k, v and the output, 4·b·heads·n·d·bytes_per, as dense
attention keeps q, k, v. The gathered blocks (b·nnz·B·d each) live only inside forward and backward:
copies that the Triton kernels DeepSpeed uses avoid by reading the blocks in place.
"""
from __future__ import annotations

import math

import torch


def kept_blocks(layout: torch.Tensor, causal: bool):
    """(h, i, j) of the blocks attention computes, diagonal blocks first when causal (they alone
    need the token-level causal mask). Causal drops blocks above the diagonal: all their keys are
    future."""
    if causal:
        layout = layout.tril()
    h, i, j = layout.nonzero(as_tuple=True)
    if causal:
        order = torch.argsort((i != j).to(torch.int8), stable=True)
        h, i, j = h[order], i[order], j[order]
    return h, i, j


def check_layout(layout: torch.Tensor, heads: int, seq_len: int, block: int):
    """A layout fits these heads and tokens, and every query block sees its own block (so that every
    query, the first of a causal sequence too, has at least one key)."""
    if seq_len % block:
        raise ValueError(f"sparse_attention: the sequence length {seq_len} is not a multiple of "
                         f"block {block}")
    nb = seq_len // block
    if layout.shape != (heads, nb, nb):
        raise ValueError(f"sparse_attention: layout has shape {tuple(layout.shape)}, expected "
                         f"[heads, n/block, n/block] = [{heads}, {nb}, {nb}]")
    if not layout.diagonal(dim1=-2, dim2=-1).all():
        raise ValueError("sparse_attention: the layout leaves a query block without its own key "
                         "block")


def block_sparse_attention(q, k, v, layout: torch.Tensor, block: int, causal: bool,
                           scale: float = None):
    """softmax(q kᵀ · scale, masked by the layout (and causally)) v, for q, k, v [batch, heads, n,
    d] and a bool layout [heads, n/block, n/block]."""
    B, H, T, d = q.shape
    check_layout(layout, H, T, block)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    h, i, j = kept_blocks(layout.to(q.device), causal)
    return _BlockSparseAttention.apply(q, k, v, h, i, j, block, causal, scale)


def sparse_forward(q, k, v, h, i, j, block: int, causal: bool, scale: float):
    """(out [batch, heads, n, d], probabilities [batch, nnz, block, block]) for the kept blocks (h,
    i, j), the causal ones' diagonal blocks first (kept_blocks)."""
    B, H, T, d = q.shape
    nb = T // block
    as_blocks = lambda t: t.view(B, H, nb, block, d)  # noqa: E731
    # BEGIN SOLUTION: block-sparse forward: gather the kept blocks, scores per block, softmax per query row.
    #   Kept block n pairs query block i[n] with key/value block j[n] of head h[n]: scores [B, nnz, block, block].
    #   Causal: the first (i == j).sum() kept blocks are diagonal; mask their future keys. One softmax per query
    #   row over all its kept blocks (max and sum reduced per row h*nb + i); return out and the probabilities p.
    qg, kg, vg = as_blocks(q)[:, h, i], as_blocks(k)[:, h, j], as_blocks(v)[:, h, j]  # [B, nnz, block, d]
    scores = (qg @ kg.transpose(-2, -1)) * scale                                      # [B, nnz, block, block]
    if causal:  # a diagonal block: query t sees keys up to t only
        diagonal = int((i == j).sum())
        future = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)
        scores[:, :diagonal].masked_fill_(future, float("-inf"))
    row = h * nb + i  # which query row of blocks each kept block belongs to
    # The row maximum only keeps exp() in range: it cancels in the ratio.
    row_max = torch.full((B, H * nb, block), float("-inf"), dtype=q.dtype, device=q.device)
    row_max = row_max.scatter_reduce(1, row[None, :, None].expand(B, -1, block), scores.amax(-1), "amax")
    p = (scores - row_max[:, row, :, None]).exp_()
    row_sum = torch.zeros(B, H * nb, block, dtype=q.dtype, device=q.device).index_add_(1, row, p.sum(-1))
    p /= row_sum[:, row, :, None]
    out = torch.zeros(B, H * nb, block, d, dtype=q.dtype, device=q.device).index_add_(1, row, p @ vg)
    # END SOLUTION
    return out.view(B, H, T, d), p


class _BlockSparseAttention(torch.autograd.Function):
    """Keeps for backward only q, k, v, the output and the probabilities P (the kept blocks'): the
    gathered blocks are gathered again in backward, as FlashAttention recomputes rather than stores.
    Backward per kept block (FlashAttention's Algorithm 4 with D = rowsum(dO * O)):
        dV_j += Pᵀ dO_i    dP = dO_i V_jᵀ    dS = P * (dP - D_i)
        dQ_i += dS K_j · scale    dK_j += dSᵀ Q_i · scale"""

    @staticmethod
    def forward(ctx, q, k, v, h, i, j, block, causal, scale):
        out, p = sparse_forward(q, k, v, h, i, j, block, causal, scale)
        ctx.save_for_backward(q, k, v, out, p, h, i, j)
        ctx.block, ctx.scale = block, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, p, h, i, j = ctx.saved_tensors
        B, H, T, d = q.shape
        block, scale = ctx.block, ctx.scale
        nb = T // block
        as_blocks = lambda t: t.reshape(B, H, nb, block, d)  # noqa: E731
        # query block and key block of each kept block, over all heads
        rows, cols = h * nb + i, h * nb + j
        do_g = as_blocks(grad_out)[:, h, i]
        qg, kg, vg = as_blocks(q)[:, h, i], as_blocks(k)[:, h, j], as_blocks(v)[:, h, j]
        D = (grad_out * out).sum(-1).view(B, H * nb, block)
        dS = p * (do_g @ vg.transpose(-2, -1) - D[:, rows, :, None]) * scale
        zeros = lambda: torch.zeros(B, H * nb, block, d, dtype=q.dtype,  # noqa: E731
                                    device=q.device)
        dq = zeros().index_add_(1, rows, dS @ kg)
        dk = zeros().index_add_(1, cols, dS.transpose(-2, -1) @ qg)
        dv = zeros().index_add_(1, cols, p.transpose(-2, -1) @ do_g)
        return (dq.view(B, H, T, d), dk.view(B, H, T, d), dv.view(B, H, T, d),
                None, None, None, None, None, None)


def dense_mask(layout: torch.Tensor, block: int, causal: bool) -> torch.Tensor:
    """The token-level mask [heads, n, n] a layout means (True: the score is kept): what dense
    attention must mask to compute the same thing. The reference for tests and the lab's grader; n x
    n on purpose."""
    mask = layout.repeat_interleave(block, -2).repeat_interleave(block, -1)
    if causal:
        mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    return mask


def masked_dense_attention(q, k, v, mask: torch.Tensor, scale: float = None):
    """Dense attention with a token mask [heads, n, n]: the n x n reference."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def score_bytes(layout: torch.Tensor, batch: int, block: int, bytes_per: int, causal: bool) -> int:
    """The softmax probabilities block-sparse attention keeps for backward, one layer."""
    nnz = int((layout.tril() if causal else layout).sum())
    return batch * nnz * block * block * bytes_per


def dense_score_bytes(batch: int, heads: int, seq_len: int, bytes_per: int) -> int:
    """The same for dense attention: every head's n x n probabilities."""
    return batch * heads * seq_len * seq_len * bytes_per


def attention_flops(
    layout: torch.Tensor, batch: int, block: int, head_dim: int, causal: bool
) -> int:
    """Forward matmul FLOPs of block-sparse attention, one layer: Q·Kᵀ and P·V, 2·B²·d each per
    block."""
    nnz = int((layout.tril() if causal else layout).sum())
    return 4 * batch * nnz * block * block * head_dim


def dense_attention_flops(batch: int, heads: int, seq_len: int, head_dim: int) -> int:
    """Forward matmul FLOPs of dense attention (masked scores are computed all the same)."""
    return 4 * batch * heads * seq_len * seq_len * head_dim
