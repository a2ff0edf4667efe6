# Lab 13: 1-bit Adam: error-compensated 1-bit compression and its all-reduce
# GENERATED from minizero/compression/onebit.py by `make labs`. Edit the TODO regions (everything else is the reference code).
#   run:   mpirun -n 4 python labs/lab13_onebit.py
#   check: python -m minizero grade --lab 13 --impl labs    (or: pytest -m lab13 --impl labs)
"""1-bit compression with error feedback, and the compressed all-reduce built on it (Tang et al. 2021).

A tensor x of n elements (padded with zeros to a multiple of 8N, so each rank's chunk packs into whole
bytes) is sent as its signs, one bit each, and ONE scale:

    c = x + e                        e: what earlier compressions of this buffer got wrong (error feedback)
    scale = ||c||_2 / sqrt(n)        the RMS of c: sign(c) * scale has the same L2 norm as c
    x' = scale * sign(c)             sign(0) counts as +1 (a bit has two values)
    e <- c - x'                      kept for the next call: what was lost is added back next time

Without e every call rounds the same way and the error accumulates as a bias; with it, the sum of the
compressed values over T calls differs from the sum of the true values by one e, which stays bounded,
so their average converges (tests/test_onebit.py measures both).

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
against 2(N-1)/N 4n for an fp32 all-reduce: 1 bit + the scales instead of 32 bits (bytes_compressed).
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
    # TODO(lab 13): 1-bit compression with error feedback.
    #   c = x + error (x alone when error is None); scale = ||c|| / sqrt(numel), the RMS of c;
    #   the signs of c packed with pack_signs (c >= 0 is +1); with feedback, error becomes what
    #   was lost, c - scale * signs (unpack_signs gives the +-1 back), written in place.
    #   Return (packed, scale as a 1-element tensor).
    raise NotImplementedError('lab 13: not implemented yet: 1-bit compression with error feedback')


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
    scale. x: flat fp32 of padded_numel(x.numel(), N) elements; worker_error like x, server_error like
    this rank's chunk (x.numel() // N), both updated in place; None: no error feedback on that side.
    Returns a new tensor like x, the same on every rank."""
    # TODO(lab 13): the compressed all-reduce: a 1-bit all-to-all, then a 1-bit all-gather.
    #   Worker: compress all of x (worker_error); chunk j of the packed signs, as _message(part,
    #   scale), goes to rank j by ONE comm.all_to_all. Server of chunk `rank`: _decode what came,
    #   average the N rows, compress that (server_error). Then ONE comm.all_gather of every
    #   rank's _message and _decode it: the flat result, chunk j from rank j.
    raise NotImplementedError('lab 13: not implemented yet: the compressed all-reduce')


if __name__ == "__main__":
    from minizero.autograde import lab_main
    lab_main(13, globals())
