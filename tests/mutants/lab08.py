"""Lab 08 (ZeRO++ int8 quantized all-gather): plausible student bugs, each caught by one check."""
from tests.mutants import Mutant

GATHER = """    wire = encode(shard, block_numel, 8)
    rows = torch.empty(comm.size, wire.shape[1], dtype=torch.uint8, device=shard.device)
    work = comm.all_gather(rows, wire, async_op=True)

    def finish():
        work.wait()
        decode(rows, shard.numel(), block_numel, 8, out=output.view(comm.size, -1))
"""  # the reference's int8 all-gather, as solutions/lab08_zeropp.py has it

MUTANTS = [
    Mutant("divides by 2^(bits-1) = 128: the largest value clips to 127",
           "scales = blocks.abs().amax(dim=-1) / qmax",
           "scales = blocks.abs().amax(dim=-1) / (qmax + 1)",
           "check_quantizer", "largest |x| of its block"),
    Mutant("truncates toward zero instead of rounding to the nearest code",
           "codes = torch.round(blocks / safe)",
           "codes = (blocks / safe)",
           "check_quantizer", "moved toward zero"),
    Mutant("one scale per row (tensor-wise), not per block: an outlier flattens its whole row",
           "scales = blocks.abs().amax(dim=-1) / qmax",
           "scales = blocks.abs().amax(dim=-1).amax(dim=-1, keepdim=True).repeat(1, blocks.shape[1]) / qmax",
           "check_quantizer", "not one scale per block"),
    Mutant("dequantize forgets to multiply by the scales",
           "return (_blocks(codes, block_numel) * _rows(scales).unsqueeze(-1)).view(rows, -1)[:, :n].to(dtype)",
           "return _blocks(codes, block_numel).view(rows, -1)[:, :n].to(dtype)",
           "check_quantizer", "far larger than x"),
    Mutant("decodes its own row for every rank instead of the gathered ones",
           "decode(rows, shard.numel(), block_numel, 8, out=output.view(comm.size, -1))",
           "decode(wire.expand(comm.size, -1), shard.numel(), block_numel, 8, out=output.view(comm.size, -1))",
           "check_matches_zero3", "decode each rank's row"),
    Mutant("quantizes the weights to int4 instead of int8",
           GATHER, GATHER.replace("block_numel, 8", "block_numel, 4"),
           "check_matches_zero3", "fits 4-bit codes"),
    Mutant("forgets to quantize: gathers the fp32 shard (right values, no bytes saved)",
           GATHER, GATHER.replace("encode(shard, block_numel, 8)", "shard.float().reshape(1, -1)")
           .replace("dtype=torch.uint8", "dtype=torch.float32")
           .replace("decode(rows, shard.numel(), block_numel, 8, out=output.view(comm.size, -1))",
                    "output.view(comm.size, -1).copy_(rows)"),
           "check_bytes", "int8 codes, 1 byte per element"),
]
