"""DeepSpeed-Ulysses: all-to-all from sequence shards to head shards, attention, and back.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models". Each of the cp ranks holds s/cp tokens of q, k and v with
all the heads. Attention mixes tokens but not heads, so one all-to-all re-cuts each tensor:

    [b, heads, s/cp, d] on each rank  --all-to-all-->  [b, heads/cp, s, d]:
                                                       whole sequence, heads/cp heads

(rank j receives head group j of every rank's tokens), each rank runs ordinary attention on its
heads over the WHOLE sequence (here torch's scaled_dot_product_attention, causal or not: no
imbalance, no ring), and one all-to-all cuts the output back to [b, heads, s/cp, d]. The backward
of an all-to-all is the inverse all-to-all, so backward runs 4 more (dO in; dq, dk, dv out).

Bytes sent per rank per attention layer (comm.stats' all_to_all: a rank keeps 1/cp of its payload):
    one all-to-all   (cp - 1)/cp x b (s/cp) h w     (h = heads x head_dim, w bytes per element)
    layer            8 x (cp - 1)/cp x b (s/cp) h w   (4 forward: q, k, v, o; 4 backward)
which falls as 1/cp: the paper's "communication volume per link 4Nh/P" per pass. Ring attention
sends (3cp - 2) x 2 b s h w / cp per layer, about cp^2 / (cp - 1) x 3/4 times more.
The limit: cp <= heads, and heads must divide by cp (refused below, before any collective).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

HEAD_DIM = 1  # [batch, heads, tokens, head_dim]


def check_heads(heads: int, cp: int):
    """Ulysses gives each rank heads/cp whole heads: a clear error before any collective."""
    if heads % cp:
        raise ValueError(f"Ulysses: {heads} attention heads are not divisible by the "
                         f"context-parallel size {cp}: each of the {cp} ranks computes heads/cp "
                         "whole heads over the whole sequence. Use a context-parallel size that "
                         f"divides {heads}, or ring attention (no constraint on heads)")


def sequence_to_heads(x: torch.Tensor, comm) -> torch.Tensor:
    """[b, heads, s/cp, d] (this rank's tokens) -> [b, heads/cp, s, d] (this rank's heads)."""
    cp = comm.size
    b, heads, tokens, d = x.shape
    # chunk j: head group j
    send = x.reshape(b, cp, heads // cp, tokens, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)  # chunk j: rank j's tokens
    comm.all_to_all(recv, send)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, heads // cp, cp * tokens, d)


def heads_to_sequence(x: torch.Tensor, comm) -> torch.Tensor:
    """[b, heads/cp, s, d] (this rank's heads) -> [b, heads, s/cp, d] (this rank's tokens)."""
    cp = comm.size
    b, group, seq, d = x.shape
    # chunk j: rank j's tokens
    send = x.reshape(b, group, cp, seq // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)  # chunk j: head group j
    comm.all_to_all(recv, send)
    return recv.transpose(0, 1).reshape(b, cp * group, seq // cp, d)


class Reshard(torch.autograd.Function):
    """One all-to-all re-cut, `there` in forward; its inverse `back` in backward (the gradient of a
    permutation of elements across ranks is the inverse permutation)."""

    @staticmethod
    def forward(ctx, x, comm, there, back):
        ctx.comm, ctx.back = comm, back
        return there(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous(), ctx.comm), None, None, None


def ulysses_attention(q, k, v, comm, causal: bool = False):
    """Attention over the whole sequence from this rank's contiguous shard [b, heads, s/cp, d] of
    q, k, v (rank r holds tokens r s/cp ... (r+1) s/cp): this rank's shard of the output."""
    check_heads(q.size(HEAD_DIM), comm.size)
    q, k, v = (Reshard.apply(t, comm, sequence_to_heads, heads_to_sequence) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return Reshard.apply(out, comm, heads_to_sequence, sequence_to_heads)


def ulysses_bytes_per_layer(batch: int, seq_len: int, hidden: int, cp: int, bytes_per: int) -> dict:
    """The formula side: bytes one rank sends per attention layer (module docstring)."""
    one = (cp - 1) / cp * batch * (seq_len // cp) * hidden * bytes_per
    return {"forward": 4 * one, "backward": 4 * one}
