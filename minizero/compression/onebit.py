"""1-bit compression with error feedback, and the compressed all-reduce built on it (Tang et al.
2021).

A tensor x of n elements (padded with zeros to a multiple of 8N, so each rank's chunk packs into
whole bytes) is sent as its signs, one bit each, and ONE scale:

    c = x + e                        e: what earlier compressions of this buffer got wrong
                                     (error feedback)
    scale = ||c||_2 / sqrt(n)        the RMS of c: sign(c) * scale has the same L2 norm as c
    x' = scale * sign(c)             sign(0) counts as +1 (a bit has two values)
    e <- c - x'                      kept for the next call: what was lost is added back next time

Without e every call rounds the same way and the error accumulates as a bias; with it, the sum of
the compressed values over T calls differs from the sum of the true values by one e, which stays
bounded, so their average converges (tests/test_onebit.py measures both).

compressed_allreduce (DeepSpeed's NcclBackend.compressed_allreduce, deepspeed/runtime/comm/nccl.py):
the average of every rank's x, as a reduce-scatter and an all-gather, each 1-bit:
  1. every rank compresses its whole x (worker error, one worker scale) and sends chunk j of the
     signs, with its scale, to rank j: one all-to-all;
  2. rank j decodes the N chunks it got, averages them, and compresses that average (server error
     of chunk j, one server scale): it is the "server" of chunk j;
  3. every rank's compressed chunk, with its scale, is all-gathered and decoded.
Signs and scale travel as ONE byte message per chunk (two collectives, two latencies, not four as in
DeepSpeed, which all-gathers the scales separately; the bytes are the same). Bytes one rank sends,
ring model (comm/stats.py), for n padded elements:
    all-to-all (N-1)/N (n/8 + 4N)  +  all-gather (N-1)/N (n/8 + 4N)   = 2(N-1)/N (n/8 + 4N)
against 2(N-1)/N 4n for an fp32 all-reduce: 1 bit + the scales instead of 32 bits
(bytes_compressed).
"""
from __future__ import annotations

import math

import torch

from minizero.comm.labels import labelled

FP32_BYTES = 4
SCALE_BYTES = 4  # one fp32 scale per compressed chunk
_BIT_WEIGHTS = [1 << i for i in range(8)]


def padded_numel(numel: int, world: int) -> int:
    """numel rounded up so each of the `world` chunks packs into whole bytes (a multiple of 8N)."""
    step = 8 * world
    return -(-numel // step) * step


def bytes_allreduce(numel: int, world: int, elem_bytes: int = FP32_BYTES) -> float:
    """Bytes one rank sends to all-reduce `numel` elements uncompressed (ring)."""
    return 2 * (world - 1) / world * elem_bytes * numel if world > 1 else 0.0


def bytes_compressed(numel: int, world: int) -> float:
    """Bytes one rank sends for compressed_allreduce of `numel` elements: signs (1 bit per padded
    element) and N scales, once in the all-to-all and once in the all-gather."""
    if world == 1:
        return 0.0
    return 2 * (world - 1) / world * (padded_numel(numel, world) / 8 + SCALE_BYTES * world)


def pack_signs(c: torch.Tensor) -> torch.Tensor:
    """Bits (c >= 0), 8 to a uint8, element i in bit i % 8 of byte i // 8; c.numel() % 8 == 0."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=c.device)
    bits = (c >= 0).view(-1, 8).to(torch.uint8)
    return (bits * weights).sum(dim=1).to(torch.uint8)  # distinct bits: the sum is their OR


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """pack_signs undone, as +1.0 / -1.0 (float32)."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = packed.view(-1, 1).bitwise_and(weights).ne(0).reshape(-1)
    return bits.float().mul_(2).sub_(1)


def compress(x: torch.Tensor, error: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs, scale) of x + error, x flat fp32 with numel % 8 == 0. With error feedback
    (`error` a tensor like x) the error is updated in place to what this compression lost; error
    None: no feedback, x alone is compressed."""
    # BEGIN SOLUTION: 1-bit compression with error feedback.
    #   What must hold: the module docstring's four lines. The receiver sees scale * sign(c), and
    #   that has c's L2 norm only if the scale is c's RMS (over all its elements). sign(0) counts as
    #   +1: a bit has two values, and pack_signs already packs c >= 0 that way (unpack_signs gives
    #   +1.0 / -1.0 back). With feedback, `error` is the caller's buffer, kept from call to call: it
    #   must be updated IN PLACE to exactly what this compression lost, measured against the values
    #   the receiver will decode. x itself is never changed; error None: no feedback, x alone is
    #   compressed.
    #   Returns (packed signs, uint8 [numel / 8]; scale, a 1-element fp32 tensor).
    c = x if error is None else x + error
    scale = c.norm() / math.sqrt(c.numel())
    packed = pack_signs(c)
    if error is not None:
        error.copy_(c - scale * unpack_signs(packed))
    return packed, scale.reshape(1)
    # END SOLUTION


def _message(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One chunk on the wire: its sign bytes, then its fp32 scale's 4 bytes."""
    return torch.cat([packed, scale.float().view(torch.uint8)])


def _decode(message: torch.Tensor) -> torch.Tensor:
    """A _message (or rows of them) back to scale * signs, one row per message."""
    rows = message.view(-1, message.shape[-1])
    scales = rows[:, -SCALE_BYTES:].contiguous().view(torch.float32)  # [rows, 1]
    return unpack_signs(rows[:, :-SCALE_BYTES].contiguous()).view(len(rows), -1) * scales


@labelled("onebit")
def compressed_allreduce(x: torch.Tensor, comm, worker_error: torch.Tensor | None = None,
                         server_error: torch.Tensor | None = None) -> torch.Tensor:
    """The average over ranks of x, each rank's x and each chunk's average sent as 1-bit signs and a
    scale. x: flat fp32 of padded_numel(x.numel(), N) elements; worker_error like x, server_error
    like this rank's chunk (x.numel() // N), both updated in place; None: no error feedback on that
    side. Returns a new tensor like x, the same on every rank."""
    # BEGIN SOLUTION: the compressed all-reduce: a 1-bit all-to-all, then a 1-bit all-gather.
    #   What must hold: the result is the same on every rank, shaped like x, and its chunk j (numel
    #   / N elements) has been compressed twice: once in each worker's x (one scale per worker,
    #   worker_error), then as the average of the N decoded chunks j, on rank j, its "server" (one
    #   scale, server_error, which is chunk-sized). Exactly two collectives, one per compression;
    #   each carries a chunk's signs AND its scale in one byte message, so the bytes are
    #   bytes_compressed's. The packed signs of a chunk are whole bytes of the packed signs of x
    #   (element i is bit i % 8 of byte i // 8; numel is a multiple of 8N).
    #   API: _message(packed, scale) is one chunk's message; _decode(messages) turns [k, bytes]
    #   messages back into [k, elements] values. comm.all_to_all(output, input): dim 0 of input is N
    #   blocks, block j goes to rank j, block j of output came from rank j. comm.all_gather(output,
    #   input): output holds comm.size x input's elements, rank r's at the r-th place.
    world, numel = comm.size, x.numel()
    chunk = numel // world
    # 1. worker: compress all of x, send chunk j's signs (and the scale) to rank j
    packed, scale = compress(x, worker_error)
    outgoing = torch.stack([_message(part, scale) for part in packed.view(world, chunk // 8)])
    incoming = torch.empty_like(outgoing)
    comm.all_to_all(incoming, outgoing)
    # 2. server of chunk `rank`: average what the N workers sent, compress that
    average = _decode(incoming).mean(dim=0)
    server_packed, server_scale = compress(average, server_error)
    # 3. every chunk's compressed average to everyone
    mine = _message(server_packed, server_scale)
    gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=x.device)
    comm.all_gather(gathered, mine)
    return _decode(gathered.view(world, -1)).reshape(-1)
    # END SOLUTION
