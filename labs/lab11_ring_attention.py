# Lab 11: Ring attention: block attention, the online-softmax merge and the ring loop
# GENERATED from minizero/context/online_softmax.py + minizero/context/layout.py + minizero/context/ring_attention.py by `make labs`. Edit the TODO regions (everything else is the reference code).
#   run:   mpirun -n 4 python labs/lab11_ring_attention.py
#   check: python -m minizero_course grade --lab 11 --impl labs    (or: pytest -m lab11 --impl labs)
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
    # TODO(lab 11): block_attention: the block's log-sum-exp L_B and its output o_B normalized by it.
    #   L_B = log sum_j exp(s_j) over the block's keys, computed stably (subtract the row max, or
    #   torch.logsumexp). o_B = softmax(s) @ v, i.e. exp(s - L_B) @ v, in v's dtype.
    #   Return (o_B, L_B) with L_B of shape [b, h, s_q] (no trailing dimension).
    raise NotImplementedError('lab 11: not implemented yet: block_attention')
    return out, lse


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor):
    """Fold one block's (o_B, L_B) into the running (o, L); (None, None) is "no block yet"."""
    if out is None:
        return block_out, block_lse
    # TODO(lab 11): merge: the online-softmax rescaling of two partial results.
    #   L = log(exp(L) + exp(L_B)) (torch.logaddexp); each output is weighted by its share of the
    #   whole denominator, exp(L_old - L) and exp(L_B - L), broadcast over head_dim.
    #   Do not change `out` in place: return the new (o, L).
    raise NotImplementedError('lab 11: not implemented yet: merge')
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


# ----------------------------------------------------------------------------- from minizero/context/layout.py
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
    # TODO(lab 11): pair_kind: which chunk pairs causal attention computes, and how.
    #   Chunk i holds tokens [i c, (i + 1) c): a query sees the keys at or before its own position.
    #   Which key chunks does every query of query_chunk see whole, which does none of them see (no
    #   work at all: not computed, not masked), and where does the mask cut a block? Non-causal
    #   attention sees every key. The whole load-balancing argument (scores_per_rank) rests on this.
    raise NotImplementedError('lab 11: not implemented yet: pair_kind')


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


# ----------------------------------------------------------------------------- from minizero/context/ring_attention.py
"""Ring attention: the sequence split over cp ranks, key/value blocks passed around a ring.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"; Megatron-LM's context parallelism (Korthikanti et al.'s successor,
`--context-parallel-size`); picotron's `context_parallel`. Each of the cp ranks holds s/cp tokens of
q, k and v. Attention needs every query against every key, so the key/value blocks travel: at step i
rank r holds the block of rank (r - i) mod cp, computes its queries against it
(online_softmax.block_attention), merges the result into its running output (online_softmax.merge),
and passes the block on to rank r+1 while it computes: the send/recv of step i+1's block is posted
(isend/irecv) BEFORE step i's compute and waited for after it, so the transfer hides behind the
compute when
    time(block compute) >= time(send one block),   2 b (s/cp) h d w / bandwidth.
No rank ever holds more than its own block and one incoming one: memory O(s/cp), scores O((s/cp)^2).

Backward (a custom autograd.Function; nothing of the ring is recorded by autograd): the blocks
travel the ring again, and with each one an accumulator of ITS gradient dK_B, dV_B: rank r adds
its queries' share (online_softmax.block_grads, from the saved final output and log-sum-exp) and
passes it on with the block. After cp steps each accumulator has visited every rank and arrives
at its owner. The accumulator of step i is received while step i+1 computes.

Bytes sent per rank per attention layer (one kv block = K and V of s/cp tokens, 2 b (s/cp) h w,
h = heads x head_dim, w bytes per element; comm.stats counts each send where it is made):
    forward   (cp - 1) x 2 b (s/cp) h w
    backward  (cp - 1) x 2 b (s/cp) h w  (the blocks again)  +  cp x 2 b (s/cp) h w  (their
              gradients)
    layer     (3cp - 2) x 2 b s h w / cp  ->  6 b s h w for large cp: the ring does not shrink the
              traffic per rank with cp (Ulysses does, ulysses.py), it hides it behind the compute.
Activations kept for backward per rank: q, k, v, o (4 b (s/cp) h w) + the log-sum-exp (b heads
(s/cp) x 4).

Causal attention with `balanced=True`: each rank holds chunks r and 2cp-1-r (layout.py), so every
rank computes the same (2cp+1) chunk pairs; blocks wholly in the future are skipped, not masked.
`work` (a BlockWork) records what this rank really computed: scores per pass, pairs by kind,
the CPU seconds spent computing and the wall seconds spent waiting for the ring.
"""

import time

import torch

from minizero.context import online_softmax

KV_TAG, GRAD_TAG = 11, 12  # the blocks and their gradient accumulators travel side by side


class BlockWork:
    """What one rank computed in ring attention, counted as it ran."""

    def __init__(self):
        self.forward_scores = 0    # q.k scores computed in forward (a diagonal pair counted whole)
        self.backward_scores = 0   # the same in backward (each pair's scores are recomputed)
        self.pairs = {"full": 0, "diagonal": 0, "skip": 0}  # forward chunk pairs by kind
        self.compute_s = 0.0  # CPU seconds of this thread in block compute (forward + backward):
                                   # work, not inflated when ranks share cores
        self.wait_s = 0.0  # seconds blocked on the ring after the compute (transfer not hidden)

    def as_dict(self) -> dict:
        return {"forward_scores": self.forward_scores, "backward_scores": self.backward_scores,
                "pairs": dict(self.pairs), "compute_s": self.compute_s, "wait_s": self.wait_s}


def _pairs(rank, source, cp, causal, balanced):
    """(query chunk index, key chunk index, kind) of every pair this rank meets in `source`'s
    block."""
    return [(qi, ki, pair_kind(a, b, causal)) for qi, a in enumerate(chunks_of(rank, cp, balanced))
            for ki, b in enumerate(chunks_of(source, cp, balanced))]


class _Ring:
    """This rank's transfers in flight. A block's compute that raises (a bad kernel) must not leave
    a posted receive writing into a buffer Python then frees: `drain` waits for every transfer first
    (all ranks post each step's transfers before computing, so they all complete)."""

    def __init__(self, comm, work):
        self.comm = comm        # the cp group
        self.work = work        # BlockWork: wait seconds are booked here
        self.inflight = []      # handles posted and not yet waited for

    def exchange(self, send, tag):
        """Post this step's ring transfer: `send` to rank+1, a same-shaped buffer from rank-1."""
        incoming = torch.empty_like(send)
        # TODO(lab 11): the ring's direction: pass `send` on and receive the neighbour's block.
        #   One isend and one irecv per rank and step, and they must pair up around the ring: what
        #   rank r sends, exactly one rank receives, from r. Blocks travel towards higher ranks and
        #   wrap around (the last rank's goes to rank 0); the backward passes its gradient
        #   accumulators the same way. comm.isend(tensor, dst, tag=tag), comm.irecv(buffer, src, tag=tag).
        raise NotImplementedError("lab 11: not implemented yet: the ring's direction")
        self.inflight.extend(pending)
        return incoming, pending

    def wait(self, pending):
        t0 = time.perf_counter()
        for handle in pending:
            handle.wait()
            self.inflight.remove(handle)
        self.work.wait_s += time.perf_counter() - t0

    def drain(self):
        for handle in self.inflight:
            handle.wait()
        self.inflight.clear()


class RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, comm, causal, balanced, work, kernels):
        ring = _Ring(comm, work)
        try:
            out, lse = _forward(ring, q, k, v, causal, balanced, kernels)
        except BaseException:
            ring.drain()
            raise
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal, ctx.balanced, ctx.work = comm, causal, balanced, work
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ring = _Ring(ctx.comm, ctx.work)
        try:
            grads = _backward(ring, grad_out, *ctx.saved_tensors, ctx.causal, ctx.balanced)
        except BaseException:
            ring.drain()
            raise
        return (*grads, None, None, None, None, None)


class _Counted:
    """The kernels as the forward loop calls them, counting in `work` what this rank really
    computes: each block's scores (a diagonal one counted whole), the pairs by kind and the CPU
    seconds."""

    def __init__(self, kernels, work):
        self.kernels, self.work = kernels, work

    def block_attention(self, q, k, v, causal=False):
        t0 = time.thread_time()
        self.work.pairs["diagonal" if causal else "full"] += 1
        self.work.forward_scores += q.size(SEQUENCE_DIM) * k.size(SEQUENCE_DIM)
        try:
            return self.kernels.block_attention(q, k, v, causal=causal)
        finally:
            self.work.compute_s += time.thread_time() - t0

    def merge(self, *partials):
        t0 = time.thread_time()
        try:
            return self.kernels.merge(*partials)
        finally:
            self.work.compute_s += time.thread_time() - t0


def _forward(ring, q, k, v, causal, balanced, kernels):
    comm, work = ring.comm, ring.work
    cp, rank, pieces = comm.size, comm.rank, 2 if balanced else 1
    kernels, computed = _Counted(kernels, work), work.pairs["full"] + work.pairs["diagonal"]
    q_chunks = q.chunk(pieces, SEQUENCE_DIM)
    outs, lses = [None] * pieces, [None] * pieces  # this rank's running (o, L) per query chunk
    blocks = torch.stack([k, v]).contiguous()  # one message per step: [2, b, heads, s/cp, d]
    for step in range(cp):
        # TODO(lab 11): the ring loop: attend to the block this rank holds at `step`, pass it on.
        #   What must hold: after `step` hops (each r -> r+1) this rank holds one other rank's
        #   block; _pairs(rank, that rank, cp, causal, balanced) lists its chunk pairs with their
        #   kind. A transfer posted (ring.exchange) BEFORE this step's compute travels while it
        #   computes; waiting (ring.wait) before computing leaves nothing to hide it behind. cp
        #   steps, cp - 1 hops: the last block goes nowhere. A 'skip' pair costs nothing; a
        #   'diagonal' one is masked inside (causal=True). Fold each result into outs[qi],
        #   lses[qi] with kernels.merge (any order gives the same o and L).
        raise NotImplementedError('lab 11: not implemented yet: the ring loop')
    # every pair not computed was skipped: cp blocks of pieces x pieces chunk pairs
    work.pairs["skip"] += cp * pieces * pieces - (
        work.pairs["full"] + work.pairs["diagonal"] - computed
    )
    return torch.cat(outs, SEQUENCE_DIM), torch.cat(lses, SEQUENCE_DIM)


def _backward(ring, grad_out, q, k, v, out, lse, causal, balanced):
    comm, work = ring.comm, ring.work
    cp, rank, pieces = comm.size, comm.rank, 2 if balanced else 1
    grad_out = grad_out.contiguous()
    delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # D = rowsum(dO * O)
    split = [t.chunk(pieces, SEQUENCE_DIM) for t in (q, out, grad_out, lse, delta)]
    grad_q = torch.zeros_like(q)
    grad_q_chunks = grad_q.chunk(pieces, SEQUENCE_DIM)  # views: adding into them fills grad_q
    blocks = torch.stack([k, v]).contiguous()
    grad_incoming, grad_pending = None, None
    for step in range(cp):
        if step < cp - 1:
            incoming, pending = ring.exchange(blocks, KV_TAG)
        t0 = time.thread_time()
        grad_blocks = torch.zeros_like(blocks)  # this rank's share of dK_B, dV_B
        k_chunks, v_chunks = (
            blocks[0].chunk(pieces, SEQUENCE_DIM),
            blocks[1].chunk(pieces, SEQUENCE_DIM),
        )
        dk_chunks, dv_chunks = (
            grad_blocks[0].chunk(pieces, SEQUENCE_DIM),
            grad_blocks[1].chunk(pieces, SEQUENCE_DIM),
        )
        for qi, ki, kind in _pairs(rank, (rank - step) % cp, cp, causal, balanced):
            if kind == "skip":
                continue
            q_c, out_c, grad_out_c, lse_c, delta_c = (s[qi] for s in split)
            work.backward_scores += q_c.size(SEQUENCE_DIM) * k_chunks[ki].size(SEQUENCE_DIM)
            dq, dk, dv = online_softmax.block_grads(q_c, k_chunks[ki], v_chunks[ki], out_c,
                                                    grad_out_c, lse_c, delta_c,
                                                    causal=kind == "diagonal")
            grad_q_chunks[qi].add_(dq)
            dk_chunks[ki].add_(dk)
            dv_chunks[ki].add_(dv)
        work.compute_s += time.thread_time() - t0
        if grad_pending is not None:  # the accumulator of this block, from the ranks before
            ring.wait(grad_pending)
            grad_blocks.add_(grad_incoming)
        if cp > 1:  # pass it on with the block: rank r+1 holds this block at its next step
            grad_incoming, grad_pending = ring.exchange(grad_blocks, GRAD_TAG)
        if step < cp - 1:
            ring.wait(pending)
            blocks = incoming
    if cp > 1:  # the last accumulator to arrive is this rank's own block's: complete
        ring.wait(grad_pending)
        grad_blocks = grad_incoming
    return grad_q, grad_blocks[0], grad_blocks[1]


def ring_attention(q, k, v, comm, causal: bool = False, balanced: bool = False,
                   work: BlockWork | None = None, kernels=online_softmax):
    """Attention over the whole sequence from this rank's shard [b, heads, s/cp, head_dim] of q, k
    and v (cut by layout.shard_sequence with the same `balanced`): this rank's shard of the output.
    `kernels` supplies block_attention and merge (lab 11 passes the student's)."""
    if not q.shape == k.shape == v.shape:
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v "
            f"{tuple(v.shape)} must have one shape [batch, heads, tokens/cp, head_dim]"
        )
    if balanced and q.size(SEQUENCE_DIM) % 2:
        raise ValueError(f"ring_attention(balanced=True): this rank's {q.size(SEQUENCE_DIM)} "
                         "tokens are not two equal chunks: shard the sequence with "
                         "layout.shard_sequence(..., balanced=True)")
    return RingAttention.apply(q, k, v, comm, causal, balanced,
                               BlockWork() if work is None else work, kernels)


def ring_bytes_per_layer(batch: int, seq_len: int, hidden: int, cp: int, bytes_per: int) -> dict:
    """The formula side: bytes one rank sends per attention layer (module docstring)."""
    block = 2 * batch * (seq_len // cp) * hidden * bytes_per
    return {"forward": (cp - 1) * block, "backward": (2 * cp - 1) * block if cp > 1 else 0}


def attention_activation_bytes(
    batch: int, seq_len: int, hidden: int, heads: int, cp: int, bytes_per: int
) -> int:
    """The formula side: what attention keeps for backward per rank, q, k, v, o and the fp32
    log-sum-exp, for ring attention, Ulysses and single-process flash SDPA (cp = 1) alike."""
    tokens = seq_len // cp
    return 4 * batch * tokens * hidden * bytes_per + batch * heads * tokens * 4


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(11, globals())
