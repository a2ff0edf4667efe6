"""Attention one block at a time: the online softmax that ring attention is built on (lab 11).

Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al. 2022,
FlashAttention (Sec. 3.1); Liu et al. 2023, "Ring Attention with Blockwise Transformers".
For one query row q and keys split into blocks B_1, B_2, ... the softmax attention

    o = sum_j exp(s_j - L) v_j,   s_j = q.k_j / sqrt(d),
    L = log sum_j exp(s_j)   (the log-sum-exp)

can be computed block by block. Block B alone gives its own normalized output and log-sum-exp

    o_B = sum_{j in B} exp(s_j - L_B) v_j,      L_B = log sum_{j in B} exp(s_j)

and two partial results merge exactly (the online-softmax rescaling):

    L   = log(exp(L_1) + exp(L_2))                      (torch.logaddexp: stable for any L_1, L_2)
    o   = exp(L_1 - L) o_1 + exp(L_2 - L) o_2

since exp(L_i - L) is block i's share of the whole softmax denominator. Merging in any order
gives the same o and L up to float rounding, so a rank can merge key/value blocks in the order
they reach it around the ring, and never holds more than one block's s_q x s_k scores.

Backward needs no merge: with the final L and o saved, block B's share of the gradients is
(FlashAttention's Algorithm 4, D = rowsum(dO * O)):

    P = exp(S - L)   dV_B = P^T dO   dP = dO V_B^T   dS = P * (dP - D)
    dQ += dS K_B / sqrt(d)   dK_B = dS^T Q / sqrt(d)

Bytes: a block's scores are s_q x s_k x 4 (fp32), freed after the block; what is kept for backward
is o (the size of q) and L (s_q fp32 values per head).

Shapes: [batch, heads, tokens, head_dim] (torch's scaled_dot_product_attention layout); L is
[batch, heads, tokens] in float32. `causal=True` means a DIAGONAL block: queries and keys are the
same positions, so query i sees keys 0..i of the block. Blocks wholly in the future are never
passed.
"""
from __future__ import annotations

import math

import torch


def score_dtype(q: torch.Tensor) -> torch.dtype:
    """Scores, log-sum-exp and softmax in float32 at least (float64 inputs stay float64)."""
    return torch.promote_types(q.dtype, torch.float32)


def causal_mask(n_queries: int, n_keys: int, device) -> torch.Tensor:
    """True where a query may NOT see a key: the upper triangle of a diagonal block."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).triu(1)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False):
    """Attention of q to ONE key/value block: (o_B, L_B), the block's normalized output and its
    log-sum-exp per query row (float32, or float64 for float64 inputs). Scores scaled by
    1/sqrt(head_dim)."""
    scale = 1.0 / math.sqrt(q.size(-1))
    scores = (q @ k.transpose(-2, -1)).to(score_dtype(q)) * scale  # [b, h, s_q, s_k]
    if causal:
        scores = scores.masked_fill(causal_mask(q.size(-2), k.size(-2), q.device), float("-inf"))
    # BEGIN SOLUTION: block_attention: the block's log-sum-exp L_B and its output o_B normalized by it.
    #   L_B = log sum_j exp(s_j) over the block's keys, computed stably (subtract the row max, or
    #   torch.logsumexp). o_B = softmax(s) @ v, i.e. exp(s - L_B) @ v, in v's dtype.
    #   Return (o_B, L_B) with L_B of shape [b, h, s_q] (no trailing dimension).
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)) @ v
    # END SOLUTION
    return out, lse


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor):
    """Fold one block's (o_B, L_B) into the running (o, L); (None, None) is "no block yet"."""
    if out is None:
        return block_out, block_lse
    # BEGIN SOLUTION: merge: the online-softmax rescaling of two partial results.
    #   L = log(exp(L) + exp(L_B)) (torch.logaddexp); each output is weighted by its share of the
    #   whole denominator, exp(L_old - L) and exp(L_B - L), broadcast over head_dim.
    #   Do not change `out` in place: return the new (o, L).
    new_lse = torch.logaddexp(lse, block_lse)
    out = (torch.exp(lse - new_lse).unsqueeze(-1) * out
           + torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out).to(block_out.dtype)
    # END SOLUTION
    return out, new_lse


def block_grads(q, k, v, out, grad_out, lse, delta, causal: bool = False):
    """Block (K_B, V_B)'s share of the gradients, from the FINAL o and L (module docstring):
    returns (dQ part, dK_B, dV_B). delta = rowsum(dO * O), [b, h, s_q], float32."""
    scale = 1.0 / math.sqrt(q.size(-1))
    scores = (q @ k.transpose(-2, -1)).to(score_dtype(q)) * scale
    if causal:
        scores = scores.masked_fill(causal_mask(q.size(-2), k.size(-2), q.device), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))                    # P, 0 where masked
    grad_v = probs.to(v.dtype).transpose(-2, -1) @ grad_out
    grad_probs = (grad_out @ v.transpose(-2, -1)).to(probs.dtype)     # dP
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1)) * scale  # dS / sqrt(d) folded in
    grad_q = grad_scores.to(q.dtype) @ k
    grad_k = grad_scores.to(q.dtype).transpose(-2, -1) @ q
    return grad_q, grad_k, grad_v
