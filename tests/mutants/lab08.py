"""Lab 08 (ZeRO++ quantized all-gather): plausible student bugs, each caught by one check; then the
stretch task's (hpZ's secondary partition, solutions/lab08_zeropp.py's ZeroPP), graded by check_hpz."""
from tests.mutants import Mutant

GATHER = """    wire = encode(shard, block_numel, 8)
    rows = torch.empty(comm.size, wire.shape[1], dtype=torch.uint8, device=shard.device)
    work = comm.all_gather(rows, wire, async_op=True)

    def finish():
        work.wait()
        decode(rows, shard.numel(), block_numel, 8, out=output.view(comm.size, -1))
"""  # the reference's int8 all-gather, as solutions/lab08_zeropp.py has it
SCALE = "scales = blocks.abs().amax(dim=-1) / qmax"
TWO_GATHERS = """    codes, scales = quantize_blockwise(shard, block_numel, 8)
    all_codes = torch.empty(comm.size, codes.shape[1], dtype=torch.int8, device=shard.device)
    all_scales = torch.empty(comm.size, scales.shape[1], dtype=torch.float32, device=shard.device)
    works = [comm.all_gather(all_codes, codes, async_op=True), comm.all_gather(all_scales, scales, async_op=True)]

    def finish():
        for w in works:
            w.wait()
        output.view(comm.size, -1).copy_(dequantize_blockwise(all_codes, all_scales, block_numel))
"""
PADDED = "return codes.view(rows, -1)[:, :n].contiguous(), scales"

MUTANTS = [
    Mutant("divides by 2^(bits-1) = 128: the largest value clips to 127", SCALE,
           "scales = blocks.abs().amax(dim=-1) / (qmax + 1)", "check_quantizer", "dividing by qmax + 1"),
    Mutant("truncates toward zero instead of rounding to the nearest code",
           "codes = torch.round(blocks / safe)", "codes = (blocks / safe)", "check_quantizer", "moved toward zero"),
    Mutant("one scale per row (tensor-wise), not per block: an outlier flattens its whole row", SCALE,
           "scales = blocks.abs().amax(dim=-1).amax(dim=-1, keepdim=True).repeat(1, blocks.shape[1]) / qmax",
           "check_quantizer", "not one scale per block"),
    Mutant("one scale per shard (the same bug, seen in the gathered weights)", SCALE,
           "scales = blocks.abs().amax(dim=-1).amax(dim=-1, keepdim=True).repeat(1, blocks.shape[1]) / qmax",
           "check_matches_zero3", "one scale per shard"),
    Mutant("scale from max x, not max |x|: a negative outlier clips", SCALE,
           "scales = blocks.amax(dim=-1) / qmax", "check_quantizer", "not max |x|"),
    Mutant("hard-codes int8's 127: 4-bit codes overflow their nibble", SCALE + "\n",
           "scales = blocks.abs().amax(dim=-1) / 127\n    qmax = 127\n", "check_quantizer", "qmax = 2^(bits-1) - 1"),
    Mutant("returns the padded codes (the last block's padding kept)", PADDED,
           "return codes.view(rows, -1).contiguous(), scales", "check_quantizer", "padding of the last block"),
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
    Mutant("codes and scales in two all-gathers (same bytes, two latencies)", GATHER, TWO_GATHERS,
           "check_one_async_gather", "ran 2 all-gathers, expected 1"),
    Mutant("a blocking all-gather (nothing left to overlap)", GATHER,
           GATHER.replace("work = comm.all_gather(rows, wire, async_op=True)", "comm.all_gather(rows, wire)")
           .replace("        work.wait()\n", ""),
           "check_one_async_gather", "was blocking"),
    Mutant("waits and decodes before returning the handle", GATHER,
           GATHER + "    finish()\n", "check_one_async_gather", "waited on the all-gather before returning"),
    Mutant("decodes before waiting (reads rows still being received)", GATHER,
           GATHER.replace("        work.wait()\n        decode(rows, shard.numel(), block_numel, 8, "
                          "out=output.view(comm.size, -1))\n",
                          "        work.wait()\n")
           .replace("    def finish():",
                    "    decode(rows, shard.numel(), block_numel, 8, out=output.view(comm.size, -1))\n\n    def "
                    "finish():"),
           "check_one_async_gather", "wrote into output before wait()"),
    Mutant("forgets to quantize: gathers the fp32 shard (right values, no bytes saved)",
           GATHER, GATHER.replace("encode(shard, block_numel, 8)", "shard.float().reshape(1, -1)")
           .replace("dtype=torch.uint8", "dtype=torch.float32")
           .replace("decode(rows, shard.numel(), block_numel, 8, out=output.view(comm.size, -1))",
                    "output.view(comm.size, -1).copy_(rows)"),
           "check_bytes", "int8 codes, 1 byte per element"),
]

# the stretch task, hpZ's secondary partition (extra points): its own mutants, graded by check_hpz alone
KEEP = "self.secondary[unit] = buf[node.rank * part:(node.rank + 1) * part].clone()"
BACKWARD = "unit.work = self.mesh.node.all_gather(buf[:unit.gathered_numel], self.secondary[unit], async_op=True)"
MUTANTS += [
    Mutant("hpZ: the secondary partition sharded over the world, not the node (its primary shard again)",
           "node = self.mesh.node\n", "node = self.comm\n", "check_hpz", "sharded over the world"),
    Mutant("hpZ: keeps the full copy of the unit instead of its part", KEEP,
           "self.secondary[unit] = buf[:unit.gathered_numel].clone()", "check_hpz", "the whole unit"),
    Mutant("hpZ: the part indexed by the node's index instead of the rank inside the node", KEEP,
           KEEP.replace("node.rank", "self.mesh.node_index"), "check_hpz",
           "expected part 1: the rank j of a node keeps part j"),
    Mutant("hpZ: the part indexed by the world rank", KEEP, KEEP.replace("node.rank", "self.comm.rank"),
           "check_hpz", "runs past the unit's end"),
    Mutant("hpZ: keeps a view of the gathered buffer, not a copy", KEEP, KEEP.replace(".clone()", ""),
           "check_hpz", "keeps the whole buffer alive"),
    Mutant("hpZ: backward gathers the primary shards over the world (ZeRO-3's gather)", BACKWARD,
           "unit.work = self.comm.all_gather(buf[:unit.gathered_numel], unit.shard.detach(), async_op=True)",
           "check_hpz", "cross-node, expected 0"),
    Mutant("hpZ: backward all-gathers the parts over the world group", BACKWARD,
           BACKWARD.replace("self.mesh.node.all_gather", "self.comm.all_gather"), "check_hpz", "over mesh.node"),
]
HPZ_GATHER = ("unit.work = self.mesh.node.all_gather(buf[:unit.gathered_numel], self.secondary[unit], "
              "async_op=True)\n")
MUTANTS += [
    Mutant("hpZ: the backward all-gather blocking", HPZ_GATHER, HPZ_GATHER.replace("async_op=True", "async_op=False"),
           "check_hpz", "was blocking (async_op=False)"),
    Mutant("hpZ: the backward all-gather waited for at once", HPZ_GATHER,
           HPZ_GATHER + "            unit.work.wait()\n", "check_hpz", "was waited for before _gather_shards returned"),
]
