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
from __future__ import annotations

import time

import torch

from minizero.context import online_softmax
from minizero.context.layout import SEQUENCE_DIM, chunks_of, pair_kind

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
        # BEGIN SOLUTION: the ring's direction: pass `send` on and receive the neighbour's block.
        #   One isend and one irecv per rank and step, and they must pair up around the ring: what
        #   rank r sends, exactly one rank receives, from r. Blocks travel towards higher ranks and
        #   wrap around (the last rank's goes to rank 0); the backward passes its gradient
        #   accumulators the same way. comm.isend(tensor, dst, tag=tag), comm.irecv(buffer, src, tag=tag).
        pending = [self.comm.isend(send, (self.comm.rank + 1) % self.comm.size, tag=tag),
                   self.comm.irecv(incoming, (self.comm.rank - 1) % self.comm.size, tag=tag)]
        # END SOLUTION
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
        # BEGIN SOLUTION: the ring loop: attend to the block this rank holds at `step`, pass it on.
        #   What must hold: after `step` hops (each r -> r+1) this rank holds one other rank's
        #   block; _pairs(rank, that rank, cp, causal, balanced) lists its chunk pairs with their
        #   kind. A transfer posted (ring.exchange) BEFORE this step's compute travels while it
        #   computes; waiting (ring.wait) before computing leaves nothing to hide it behind. cp
        #   steps, cp - 1 hops: the last block goes nowhere. A 'skip' pair costs nothing; a
        #   'diagonal' one is masked inside (causal=True). Fold each result into outs[qi],
        #   lses[qi] with kernels.merge (any order gives the same o and L).
        source = (rank - step) % cp  # whose block this rank holds now
        if step < cp - 1:
            incoming, pending = ring.exchange(blocks, KV_TAG)
        k_chunks, v_chunks = blocks[0].chunk(pieces, SEQUENCE_DIM), blocks[1].chunk(pieces, SEQUENCE_DIM)
        for qi, ki, kind in _pairs(rank, source, cp, causal, balanced):
            if kind == "skip":
                continue
            block = kernels.block_attention(q_chunks[qi], k_chunks[ki], v_chunks[ki], causal=kind == "diagonal")
            outs[qi], lses[qi] = kernels.merge(outs[qi], lses[qi], *block)
        if step < cp - 1:
            ring.wait(pending)
            blocks = incoming
        # END SOLUTION
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
