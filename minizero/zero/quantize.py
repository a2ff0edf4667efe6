"""minizero.zero.quantize: block-wise quantization in plain torch, and the two quantized collectives
of ZeRO++ (Wang et al. 2023): qwZ's int8 all-gather of weights (lab 08) and qgZ's int4
hierarchical all-to-all reduce of gradients.

Block-wise symmetric ("absmax") quantization to `bits` bits, qmax = 2^(bits-1) - 1 (127 for int8,
7 for int4). Each row of x is cut into blocks of B = block_numel elements (the last one may be
shorter: odd sizes need no padding on the wire); per block

    scale = max|x| / qmax        code = round(x / scale) in [-qmax, qmax]        x' = code * scale

so |x - x'| <= scale / 2 in every block (tests/test_quantize.py checks it, odd sizes included). A
block of zeros has scale 0 and codes 0. One fp32 scale per block confines an outlier's damage to
its own block: with one scale per tensor, one large weight would round every small one to 0.
DeepSpeed's CUDA kernels use groups of about 4-8K elements; this is the same arithmetic in torch,
so it runs on CPU (and on CUDA tensors unchanged).

Bytes on the wire, for n elements in blocks of B: int8 n + 4*ceil(n/B); int4 packs two codes per
byte (pack_int4), ceil(n/2) + 4*ceil(n/B). Against 16-bit values that is ~0.5x and ~0.25x.

quantized_all_gather (qwZ): quantize this rank's shard, all-gather codes and scales as ONE message
(encode: [codes | scale bytes]; two collectives would cost two latencies), dequantize everything
into `output`. Bytes each rank sends (ring): (N-1)/N * N * (s + 4*ceil(s/B)) for a shard of s
elements: about half of a 16-bit all-gather's (N-1)/N * 2Ns.

hierarchical_reduce_scatter (qgZ): ZeRO-3's ring reduce-scatter replaced by two all-to-alls of
int4 codes. World rank r = node * k + local (the Mesh's order: k ranks per node, `nodes` nodes);
the input is N = nodes * k shards of s elements and rank r must end with the average of shard r.
  hop 1, inside the node: local rank j needs shards (0, j), (1, j), ... (every node's rank-j
    shard), so each rank sends that row of its input, quantized, to local rank j (DeepSpeed's
    "tensor slice reordering"); j dequantizes the k rows it got and sums them in fp32;
  hop 2, across nodes: that node-sum is `nodes` shards; shard m goes, quantized again, to rank j
    of node m, which dequantizes, sums and divides by N.
Cross-node bytes per node: k ranks x (nodes-1)/nodes x (s/2 + scales) each, about
(nodes-1)/nodes * 0.25 of the 16-bit gradient, against (N-1)/N * 1 for the ring (comm/stats.py).
Every contribution is quantized once per hop (twice in all); a hop over a group of one rank is
skipped, unquantized. Any N, k, s work: blocks may be short and int4 rows are padded to whole bytes.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from minizero.comm.labels import labelled

BITS = (4, 8)
LITTLE_ENDIAN = sys.byteorder == "little"  # the int16 view of two int8 codes (_pack_int4_into)
# encode/decode a quarter-MB of fp32 at a time: 3x faster than whole 3M-element tensors
CHUNK_NUMEL = 1 << 16


class Pending:
    """A handle like Communicator's: wait() completes the operation (once), e.g. waits for the
    gathers and then dequantizes."""

    def __init__(self, finish):
        self._finish = finish  # what completing it takes
        self._done = False     # wait() already ran it

    def wait(self):
        if not self._done:
            self._finish()
            self._done = True
        return True


def check_block_numel(block_numel, what="block_numel"):
    if isinstance(block_numel, bool) or not isinstance(block_numel, int) or block_numel <= 0:
        raise ValueError(f"{what} must be a positive int (elements per quantization block), got "
                         f"{block_numel!r}")


def _rows(x):
    return x.reshape(1, -1) if x.dim() == 1 else x


def _blocks(x, block_numel):
    """[rows, n] -> float32 [rows, ceil(n / B), B], the last block zero-padded (local only; no copy
    when x is fp32 and n a multiple of B)."""
    rows, n = x.shape
    nblocks = -(-n // block_numel)
    x = x.float()
    if nblocks * block_numel != n:
        x = F.pad(x, (0, nblocks * block_numel - n))
    return x.reshape(rows, nblocks, block_numel)


def quantize_blockwise(x, block_numel, bits=8):
    """x (1-D, or 2-D: each row on its own) -> (codes int8 [rows, n], scales fp32 [rows,
    ceil(n/B)])."""
    check_block_numel(block_numel)
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    x = _rows(x)
    rows, n = x.shape
    qmax = 2 ** (bits - 1) - 1
    # BEGIN SOLUTION: block-wise absmax quantization.
    #   Invariant: |x - code * scale| <= scale / 2 for every element, at 4 AND 8 bits.
    #   The block's largest |x| (of either sign) must land exactly on +-qmax, and one
    #   scale per block of block_numel elements (not per row) keeps an outlier's
    #   damage inside its own block (_blocks pads the last, short block).
    #   Returns int8 codes of shape [rows, n] (the padding is not sent) and fp32 scales
    #   [rows, ceil(n / B)]; a block of zeros has scale 0 and codes 0.
    blocks = _blocks(x, block_numel)
    scales = blocks.abs().amax(dim=-1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    codes = torch.round(blocks / safe).clamp_(-qmax, qmax).to(torch.int8)  # (a new tensor: x stays as it was)
    return codes.view(rows, -1)[:, :n].contiguous(), scales
    # END SOLUTION


def dequantize_blockwise(codes, scales, block_numel, dtype=torch.float32):
    """(codes [rows, n], scales [rows, ceil(n/B)]) -> values [rows, n] in `dtype`."""
    check_block_numel(block_numel)
    codes = _rows(codes)
    rows, n = codes.shape
    # BEGIN SOLUTION: dequantize: each code times its block's scale.
    #   x' = code * scale, the scale of the block the code lies in (element j of a row is
    #   in block j // B); the result has the codes' shape [rows, n], in `dtype`.
    return (_blocks(codes, block_numel) * _rows(scales).unsqueeze(-1)).view(rows, -1)[:, :n].to(dtype)
    # END SOLUTION


# ----------------------------------------------------------------------------- on the wire
def pack_int4(codes):
    """int8 codes in [-7, 7], [rows, n] -> uint8 [rows, ceil(n/2)]: two 4-bit codes per byte."""
    rows, n = codes.shape
    nibbles = (F.pad(codes, (0, n % 2)) + 8).to(torch.uint8).view(rows, -1, 2)
    return nibbles[..., 0] | (nibbles[..., 1] << 4)


def unpack_int4(packed, n):
    """Inverse of pack_int4: uint8 [rows, ceil(n/2)] -> int8 [rows, n]."""
    low = (packed & 15).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).view(packed.shape[0], -1)[:, :n]


def _step(block_numel, bits):
    """Columns encoded at a time: whole blocks (and an even count for int4), about CHUNK_NUMEL."""
    step = max(1, CHUNK_NUMEL // block_numel) * block_numel
    return 2 * step if bits == 4 and step % 2 else step


def _pack_int4_into(codes, out):
    """pack_int4's bytes for int8 codes [rows, m], m even, written into uint8 `out` [rows, m // 2];
    codes is overwritten. Each pair of codes, +8, read as one little-endian int16 v = b0 + 256 b1 (0
    < b < 16): the packed byte b0 | b1 << 4 is the low byte of v | v >> 4. Three contiguous passes
    instead of strided ones (3.5x faster on a 64K chunk than the nibble view)."""
    if not codes.is_contiguous() or codes.storage_offset() % 2:  # the int16 view needs aligned rows
        codes = codes.clone(memory_format=torch.contiguous_format)
    codes.add_(8)
    pairs = codes.reshape(-1).view(torch.int16).view(codes.shape[0], -1)
    out.copy_(pairs.bitwise_or(pairs >> 4))  # int16 -> uint8 keeps the low byte


def _unpack_int4_into(packed, buf):
    """unpack_int4's codes (both nibbles of every byte, 2 x packed's columns) written into int8
    `buf`: each byte p as an int16, (p | p << 4) & 0x0F0F has p's low nibble in its low byte and its
    high nibble in its high byte (little-endian), then -8."""
    wide = packed.to(torch.int16)
    torch.bitwise_and(wide.bitwise_or_(wide << 4), 0x0F0F, out=buf.view(torch.int16))
    buf.sub_(8)


@labelled("mz.quantize.encode")  # a profiler range (comm/labels.py)
def encode(x, block_numel, bits):
    """Rows of x -> uint8 rows [codes (packed for int4) | fp32 scales as bytes], one buffer to send.
    Quantized a chunk of columns at a time: identical codes, but each pass stays in the cache, and
    each chunk's codes are written (packed) straight into the buffer that is sent."""
    x = _rows(x)
    rows, n = x.shape
    code_bytes = -(-n // 2) if bits == 4 else n
    wire = torch.empty(rows, code_bytes + 4 * -(-n // block_numel), dtype=torch.uint8,
                       device=x.device)
    scales = []
    step = _step(block_numel, bits)
    for start in range(0, n, step):
        chunk_codes, chunk_scales = quantize_blockwise(x[:, start:start + step], block_numel, bits)
        width = chunk_codes.shape[1]
        if bits == 8:
            wire[:, start:start + width].copy_(chunk_codes.view(torch.uint8))
        # an odd last chunk (padded, as pack_int4 does), or big-endian
        elif width % 2 or not LITTLE_ENDIAN:
            wire[:, start // 2:start // 2 + (width + 1) // 2].copy_(pack_int4(chunk_codes))
        else:
            _pack_int4_into(chunk_codes, wire[:, start // 2:start // 2 + width // 2])
        scales.append(chunk_scales)
    wire[:, code_bytes:].copy_(torch.cat(scales, dim=1).view(torch.uint8))
    return wire


@labelled("mz.quantize.decode")
def decode(wire, n, block_numel, bits, out=None, sum_rows=False):
    """Inverse of encode: uint8 rows -> rows of n values, written into `out` (any float dtype) if
    given, else a new fp32 tensor; sum_rows: their fp32 sum instead, one row of n. A chunk of
    columns at a time, like encode (int4 codes unpacked into one reused buffer)."""
    code_bytes = -(-n // 2) if bits == 4 else n
    # aligned
    scales = wire[:, code_bytes:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    if out is None:
        out = (
            torch.empty(n, device=wire.device)
            if sum_rows
            else torch.empty(wire.shape[0], n, device=wire.device)
        )
    step = _step(block_numel, bits)
    unpacked = (
        torch.empty(wire.shape[0], step, dtype=torch.int8, device=wire.device)
        if bits == 4
        else None
    )
    for start in range(0, n, step):
        stop = min(n, start + step)
        if bits == 4:  # start is even: byte start // 2 holds codes start and start + 1
            packed = wire[:, start // 2:(stop + 1) // 2]
            if LITTLE_ENDIAN:
                _unpack_int4_into(packed, unpacked[:, :2 * packed.shape[1]])
                codes = unpacked[:, :stop - start]
            else:
                codes = unpack_int4(packed, stop - start)
        else:
            codes = wire[:, start:stop].view(torch.int8)
        values = dequantize_blockwise(codes,
                                      scales[:, start // block_numel:-(-stop // block_numel)],
                                      block_numel)
        # v0 + v1, as the sum over two rows (never -0.0: code * scale)
        if sum_rows and values.shape[0] == 2:
            torch.add(values[0], values[1], out=out[start:stop])
        elif sum_rows:
            torch.sum(values, dim=0, out=out[start:stop])
        else:
            out[:, start:stop] = values
    return out


def quantized_all_gather(comm, output, shard, block_numel, async_op=False):
    """qwZ: output (comm.size * shard.numel() elements, any float dtype) = every rank's shard,
    block-quantized to int8 for the trip. Returns a Pending handle when async_op, else None."""
    if output.numel() != comm.size * shard.numel():
        raise ValueError(f"quantized_all_gather: output has {output.numel()} elements, expected "
                         f"{comm.size} x {shard.numel()}")
    # BEGIN SOLUTION: the int8 all-gather: one message per rank, codes and scales together.
    #   Bytes per rank: s + 4 * ceil(s / B) for a shard of s elements (int8 codes + fp32
    #   scales), in ONE collective: each collective pays a latency, so encode's
    #   [codes | scale bytes] row is what travels. comm.all_gather(output, input,
    #   async_op=True) fills output (comm.size x input, same dtype) and returns a handle;
    #   the gathered bytes are valid only after handle.wait(). So the call must return
    #   with the gather still in flight (FSDP prefetches with it), and finish() decodes
    #   every rank's row (its codes with ITS scales) into output only after the wait.
    wire = encode(shard, block_numel, 8)
    rows = torch.empty(comm.size, wire.shape[1], dtype=torch.uint8, device=shard.device)
    work = comm.all_gather(rows, wire, async_op=True)

    def finish():
        work.wait()
        decode(rows, shard.numel(), block_numel, 8, out=output.view(comm.size, -1))
    # END SOLUTION
    pending = Pending(finish)
    if async_op:
        return pending
    pending.wait()
    return None


def _all_to_all_sum(comm, rows, block_numel, bits):
    """Row j of `rows` goes (quantized) to rank j of comm; returns the fp32 sum of the rows
    received."""
    if comm.size == 1:
        return rows[0].float()
    wire = encode(rows, block_numel, bits)
    received = torch.empty_like(wire)
    comm.all_to_all(received, wire)
    return decode(received, rows.shape[1], block_numel, bits, sum_rows=True)


def hierarchical_reduce_scatter(node, cross_node, output, input, block_numel, bits=4):
    """qgZ: output (s elements, fp32) = the average over all node.size * cross_node.size ranks of
    this rank's shard of `input` (N * s elements), sent as `bits`-bit codes in two all-to-all
    hops."""
    k, nodes, s = node.size, cross_node.size, output.numel()
    if input.numel() != k * nodes * s:
        raise ValueError(f"hierarchical_reduce_scatter: input has {input.numel()} elements, "
                         f"expected {k} x {nodes} x {s}")
    # row j: every node's rank-j shard
    rows = input.view(nodes, k, s).transpose(0, 1).reshape(k, nodes * s)
    node_sum = _all_to_all_sum(node, rows, block_numel, bits)               # hop 1, inside the node
    # hop 2, across nodes
    total = _all_to_all_sum(cross_node, node_sum.view(nodes, s), block_numel, bits)
    torch.div(total, k * nodes, out=output)
