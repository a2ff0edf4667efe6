"""Which tokens a context-parallel rank holds, and the causal work that follows from it.

Causal attention is a lower triangle: query chunk a needs key chunks 0..a. Split the sequence
into cp contiguous shards and rank r computes r full blocks + 1 diagonal block of (s/cp)^2 scores:
the last rank computes cp times the first one's scores (2cp - 1 times its unmasked ones: 2r + 1
half blocks), and in a ring every step waits for the slowest rank.

Load balancing (Megatron-LM's context parallelism and picotron; Brandon et al. 2023's
"striped" attention is a finer variant): cut the sequence into 2*cp chunks of c = s/(2cp) tokens and
give rank r chunks r and 2cp-1-r, one from each end. Query chunk r needs r+1 key chunks and chunk
2cp-1-r needs 2cp-r: every rank computes 2cp+1 chunk pairs (2cp-1 full, 2 diagonal), the same on
every rank:

    scores computed per rank, causal:
        contiguous: (r + 1) (s/cp)^2      balanced: (2cp + 1) (s/(2cp))^2

(a diagonal pair counted whole: it is computed, then half of it masked). Non-causal attention has
no imbalance: every rank computes cp (s/cp)^2 scores either way.
"""
from __future__ import annotations

import torch

SEQUENCE_DIM = 2  # [batch, heads, tokens, head_dim]


def chunks_of(rank: int, cp: int, balanced: bool) -> list[int]:
    """The chunk indices rank `rank` holds, in order: chunks of s/(2cp) tokens when balanced
    (two mirrored chunks), of s/cp tokens otherwise (one)."""
    return [rank, 2 * cp - 1 - rank] if balanced else [rank]


def check_sequence(seq_len: int, cp: int, balanced: bool):
    """Context parallelism cuts the sequence into equal chunks: a clear error before any
    collective."""
    parts = 2 * cp if balanced else cp
    if seq_len % parts:
        why = (f"2 x cp = {parts} chunks (load balancing: two mirrored chunks per rank)" if balanced
               else f"cp = {cp} shards")
        raise ValueError(f"context parallelism: sequence length {seq_len} is not divisible into "
                         f"{why}. Use a sequence length that is a multiple of {parts}")


def shard_sequence(
    full: torch.Tensor, rank: int, cp: int, balanced: bool, dim: int = SEQUENCE_DIM
) -> torch.Tensor:
    """This rank's tokens of a tensor every rank holds whole (no communication)."""
    check_sequence(full.size(dim), cp, balanced)
    pieces = full.chunk(2 * cp if balanced else cp, dim)
    return torch.cat([pieces[i] for i in chunks_of(rank, cp, balanced)], dim)


def unshard_sequence(
    parts: list[torch.Tensor], balanced: bool, dim: int = SEQUENCE_DIM
) -> torch.Tensor:
    """The whole sequence from every rank's shard (rank order): the inverse of shard_sequence."""
    cp = len(parts)
    pieces: list = [None] * (2 * cp if balanced else cp)
    for rank, part in enumerate(parts):
        for index, piece in zip(chunks_of(rank, cp, balanced),
                                part.chunk(2 if balanced else 1, dim)):
            pieces[index] = piece
    return torch.cat(pieces, dim)


def pair_kind(query_chunk: int, key_chunk: int, causal: bool) -> str:
    """'full', 'diagonal' (causal within the block) or 'skip' (keys wholly in the future)."""
    # BEGIN SOLUTION: pair_kind: which chunk pairs causal attention computes, and how.
    #   Chunk i holds tokens [i c, (i + 1) c): a query sees the keys at or before its own position.
    #   Which key chunks does every query of query_chunk see whole, which does none of them see (no
    #   work at all: not computed, not masked), and where does the mask cut a block? Non-causal
    #   attention sees every key. The whole load-balancing argument (scores_per_rank) rests on this.
    if not causal or key_chunk < query_chunk:
        return "full"
    return "diagonal" if key_chunk == query_chunk else "skip"
    # END SOLUTION


def scores_per_rank(seq_len: int, cp: int, causal: bool, balanced: bool) -> list[int]:
    """The formula side of the per-rank work: q.k scores each rank computes in forward (a diagonal
    pair counted whole), from chunks_of and pair_kind alone."""
    chunk = seq_len // (2 * cp if balanced else cp)
    out = []
    for rank in range(cp):
        pairs = sum(pair_kind(a, b, causal) != "skip" for a in chunks_of(rank, cp, balanced)
                    for other in range(cp) for b in chunks_of(other, cp, balanced))
        out.append(pairs * chunk * chunk)
    return out
