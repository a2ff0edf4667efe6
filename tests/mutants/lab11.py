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
