"""Lab 11's mutants: plausible student bugs in block attention and the online-softmax merge
(solutions/lab11_ring_attention.py). tests/test_mutants.py grades them with every lab's, sharing one
launch per check worker."""
from tests.mutants import Mutant

LSE = "    lse = torch.logsumexp(scores, dim=-1)\n"
OUT = "    out = (torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)) @ v\n"
NEW_LSE = "    new_lse = torch.logaddexp(lse, block_lse)\n"
MERGED = """    out = (torch.exp(lse - new_lse).unsqueeze(-1) * out
           + torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out).to(block_out.dtype)
"""

MUTANTS = [
    Mutant("log-sum-exp without subtracting the max (overflows)", LSE,
           "    lse = torch.log(torch.exp(scores).sum(-1))\n", "check_block", "subtract the row max"),
    Mutant("L_B keeps its last dimension", LSE + OUT,
           "    lse = torch.logsumexp(scores, dim=-1, keepdim=True)\n    out = (torch.exp(scores - lse).to(v.dtype)) @ "
           "v\n",
           "check_block", "no keepdim"),
    Mutant("o_B not normalized", OUT, "    out = (torch.exp(scores).to(v.dtype)) @ v\n", "check_block",
           "not normalized"),
    Mutant("log-sum-exp over the queries", LSE, "    lse = torch.logsumexp(scores, dim=-2)\n", "check_block",
           "over the block's keys (dim -1)"),
    Mutant("merged L is the max, not logaddexp", NEW_LSE, "    new_lse = torch.maximum(lse, block_lse)\n",
           "check_merge", "it is max(L_1, L_2)"),
    Mutant("merged L is L_1 + L_2", NEW_LSE, "    new_lse = lse + block_lse\n", "check_merge", "not +"),
    Mutant("merged L through exp and log (overflows)", NEW_LSE,
           "    new_lse = torch.log(torch.exp(lse) + torch.exp(block_lse))\n", "check_merge", "overflows float32"),
    Mutant("outputs added without the weights", MERGED, "    out = (out + block_out).to(block_out.dtype)\n",
           "check_merge", "added without the weights exp(L_i - L)"),
    Mutant("weights swapped", MERGED, MERGED.replace("* out\n", "* @@\n").replace("* block_out)", "* out)")
           .replace("@@", "block_out"), "check_merge", "the weights are swapped"),
    Mutant("weights exp(L_i) divided by their sum (overflows)", MERGED,
           "    out = ((torch.exp(lse).unsqueeze(-1) * out + torch.exp(block_lse).unsqueeze(-1) * block_out)\n"
           "           / (torch.exp(lse) + torch.exp(block_lse)).unsqueeze(-1)).to(block_out.dtype)\n",
           "check_merge", "not finite for large L"),
    Mutant("rescales `out` in place", MERGED, MERGED.replace("(torch.exp(lse - new_lse).unsqueeze(-1) * out",
                                                             "(out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))"),
           "check_merge", "in place"),
    Mutant("outputs averaged (ring attention)", MERGED, "    out = ((out + block_out) / 2).to(block_out.dtype)\n",
           "check_ring", "ring attention (cp=4, causal, balanced) with your block_attention and merge"),
    Mutant("L never updated (ring attention)", NEW_LSE, "    new_lse = lse\n", "check_ring",
           "differs from torch's scaled_dot_product_attention"),
]

# bfloat16 inputs: dtypes kept (o_B in v's dtype, the log-sum-exp in float32)
MUTANTS += [
    Mutant("o_B left in float32 for bfloat16 v (not cast back)", OUT,
           "    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(scores.dtype)\n", "check_block", "in v's dtype"),
    Mutant("L_B cast to the input dtype", LSE, "    lse = torch.logsumexp(scores, dim=-1).to(q.dtype)\n",
           "check_block", "keep the log-sum-exp in float32"),
    Mutant("L_B computed in the input dtype, returned as float32", LSE,
           "    lse = torch.logsumexp(scores.to(q.dtype), dim=-1).float()\n", "check_block",
           "went through a 16-bit dtype"),
    Mutant("merged output left in float32 (the weights promote it)", MERGED,
           MERGED.replace(").to(block_out.dtype)", ")"), "check_merge", "cast the result back to the blocks' dtype"),
    Mutant("merged L cast to the outputs' dtype", NEW_LSE,
           "    new_lse = torch.logaddexp(lse, block_lse).to(block_out.dtype)\n", "check_merge",
           "do not cast it to the outputs' dtype"),
]

# the ring loop: layout.pair_kind, ring_attention's exchange and forward loop (graded on a simulated ring)
KIND = "    if not causal or key_chunk < query_chunk:\n"
SEND = "self.comm.isend(send, (self.comm.rank + 1) % self.comm.size, tag=tag)"
RECV = "self.comm.irecv(incoming, (self.comm.rank - 1) % self.comm.size, tag=tag)"
POST = "        if step < cp - 1:\n            incoming, pending = ring.exchange(blocks, KV_TAG)\n        k_chunks"
FOLD = "            outs[qi], lses[qi] = kernels.merge(outs[qi], lses[qi], *block)\n"
WAIT = "        if step < cp - 1:\n            ring.wait(pending)\n            blocks = incoming\n    # every pair"
SKIP = "            if kind == \"skip\":\n                continue\n            block = kernels.block_attention("
LOOP = (POST + """, v_chunks = blocks[0].chunk(pieces, SEQUENCE_DIM), blocks[1].chunk(pieces, SEQUENCE_DIM)
        for qi, ki, kind in _pairs(rank, source, cp, causal, balanced):
            if kind == "skip":
                continue
            block = kernels.block_attention(q_chunks[qi], k_chunks[ki], v_chunks[ki], causal=kind == "diagonal")
""" + FOLD + WAIT)
MUTANTS += [
    Mutant("pair_kind: the future computed, the past skipped", KIND,
           KIND.replace("key_chunk < query_chunk", "key_chunk > query_chunk"), "check_ring_loop",
           "wholly in the FUTURE"),
    Mutant("pair_kind: the diagonal block not masked", KIND, KIND.replace("<", "<="), "check_ring_loop",
           "the mask cuts the block"),
    Mutant("pair_kind: skips the future without the causal mask too", KIND,
           "    if key_chunk < query_chunk:\n", "check_ring_loop", "without the causal mask"),
    Mutant("exchange: the ring turned the wrong way", SEND + ",\n                   " + RECV,
           SEND.replace("+ 1", "- 1") + ",\n                   " + RECV.replace("- 1", "+ 1"), "check_ring_loop",
           "exchange sent the block to rank"),
    Mutant("exchange: receives from the rank it sends to (would never complete)", RECV, RECV.replace("- 1", "+ 1"),
           "check_ring_loop", "exchange received from rank"),
    Mutant("loop: the block held taken as (rank + step)'s", "source = (rank - step) % cp",
           "source = (rank + step) % cp", "check_ring_loop", "(rank + step) % cp"),
    Mutant("loop: the transfer posted after the compute", LOOP,
           LOOP.replace(POST, "        k_chunks").replace(FOLD, FOLD + POST.removesuffix("        k_chunks")),
           "check_ring_loop", "posted after its block's compute began"),
    Mutant("loop: waits for the next block before computing", LOOP,
           LOOP.replace("KV_TAG)\n", "KV_TAG)\n            ring.wait(pending)\n")
           .replace("            ring.wait(pending)\n            blocks", "            blocks"), "check_ring_loop",
           "waited for the next block before computing"),
    Mutant("loop: the received block never kept (blocks = incoming missing)", WAIT,
           WAIT.replace("            blocks = incoming\n", ""), "check_ring_loop", "own key block at every step"),
    Mutant("loop: 'skip' pairs computed", SKIP, "            block = kernels.block_attention(",
           "check_ring_loop", "wholly in the future"),
    Mutant("loop: the diagonal block not masked", 'causal=kind == "diagonal")\n' + FOLD,
           "causal=False)\n" + FOLD, "check_ring_loop", "only a 'diagonal' pair is masked"),
    Mutant("loop: each block replaces the running output (no merge)", FOLD,
           "            outs[qi], lses[qi] = block\n", "check_ring_loop", "fold each block into"),
]
# one task's bug in a check that needs it only: the other tasks' checks keep their points
MUTANTS += [
    Mutant("loop: one hop too many (a transfer posted and waited at the last step too)", LOOP,
           LOOP.replace("if step < cp - 1:", "if step < cp:"), "check_ring_loop", "cp - 1 hops"),
    Mutant("loop: the last step's transfer posted and never waited", POST,
           POST.replace("cp - 1", "cp"), "check_ring_loop", "cp - 1 hops"),
]
