"""Lab 14's mutants: plausible student bugs in the fixed layout, the block-sparse forward and the random
blocks of the stretch task (solutions/lab14_sparse_attention.py).
tests/test_mutants.py grades them with every lab's, sharing one launch per check worker."""
from tests.mutants import Mutant

WINDOWS = "            _window(layout, start, min(start + L, nb), self.causal)"
OFFSET = "        offset = L - (1 + h % self.num_different_global_patterns) * G"
SHORT = '''        if full_windows_end < nb:  # a short last window: its global blocks, kept inside the sequence
            starts.append(min(full_windows_end + offset, nb - G))
'''
HORIZONTAL = '''            if self.horizontal_global_attention:
                layout[g:g + G, :] = True
'''
SCORES = "    scores = (qg @ kg.transpose(-2, -1)) * scale "
NORMALIZE = "    p /= row_sum[:, row, :, None]\n"
OUT = "index_add_(1, row, p @ vg)\n"

MUTANTS = [
    Mutant("local windows ignore causality (full squares)", WINDOWS, WINDOWS.replace("self.causal)", "False)"),
           "check_layout", "above the diagonal"),
    Mutant("global columns start at row 0 when causal", "layout[g if self.causal else 0:, g:g + G] = True",
           "layout[:, g:g + G] = True", "check_layout", "starts at the global block's own row"),
    Mutant("the FIRST block of each window is global", OFFSET,
           "        offset = (h % self.num_different_global_patterns) * G", "check_layout", "the LAST"),
    Mutant("the short last window gets no global block", SHORT, "", "check_layout", "short last window"),
    Mutant("horizontal_global_attention ignored", HORIZONTAL, "", "check_layout", "horizontal_global_attention"),
    Mutant("every head gets head 0's global blocks", OFFSET, "        offset = L - G", "check_layout",
           "every head got the same"),
    Mutant("scores not scaled by 1/sqrt(d)", SCORES, "    scores = (qg @ kg.transpose(-2, -1))         ",
           "check_forward", "not scaled"),
    Mutant("diagonal blocks not causally masked", '        scores[:, :diagonal].masked_fill_(future, float("-inf"))',
           "        pass", "check_forward", "not causally masked"),
    Mutant("softmax per block instead of per query row", NORMALIZE, "    p /= p.sum(-1, keepdim=True)\n",
           "check_forward", "normalized on its own"),
    Mutant("no row maximum subtracted before exp", "    p = (scores - row_max[:, row, :, None]).exp_()",
           "    p = scores.exp()", "check_forward", "overflows"),
    Mutant("key blocks gathered at the query block's index", "as_blocks(k)[:, h, j], as_blocks(v)[:, h, j]  # [B",
           "as_blocks(k)[:, h, i], as_blocks(v)[:, h, j]  # [B",
           "check_forward", "the key blocks were gathered at the query block's index"),
    Mutant("output normalized at the end, p returned unnormalized",
           NORMALIZE + "    out = torch.zeros(B, H * nb, block, d, "
           "dtype=q.dtype, device=q.device)." + OUT, "    out = torch.zeros(B, H * nb, block, d, dtype=q.dtype, "
           "device=q.device).index_add_(1, row, p @ vg) / row_sum[..., None]\n", "check_forward",
           "normalized probabilities"),
    Mutant("random blocks from the global RNG", "torch.randperm(choices, generator=generator)",
           "torch.randperm(choices)", "check_random", "differ between ranks"),
    Mutant("causal random blocks drawn over the whole row", "        choices = row + 1 if causal else nb",
           "        choices = nb", "check_random", "above the diagonal"),
]

# a layout with more heads than global patterns, over a sequence that ends in a short window
MUTANTS += [
    Mutant("head h takes pattern h, not h mod num_different_global_patterns", OFFSET,
           "        offset = L - (1 + h) * G", "check_layout",
           "h mod num_different_global_patterns"),
    Mutant("the short last window's global blocks ignore the head's pattern", SHORT,
           SHORT.replace("full_windows_end + offset", "full_windows_end + L - G"), "check_layout",
           "the short last window's global blocks move with the head's pattern"),
]

# forward slips that dense attention alone cannot tell apart: each against the slip's own result
MUTANTS += [
    Mutant("the row index leaves out the head (row = i)", "    row = h * nb + i  #",
           "    row = i  #", "check_forward", "the heads' rows were merged"),
    Mutant("the causal token mask applied to every kept block",
           '        scores[:, :diagonal].masked_fill_(future, float("-inf"))',
           '        scores.masked_fill_(future, float("-inf"))', "check_forward",
           "every kept block"),
    Mutant("the scale applied twice (1/d)", SCORES,
           "    scores = (qg @ kg.transpose(-2, -1)) * scale ** 2", "check_forward",
           "scaled by 1/head_dim"),
    Mutant("value blocks gathered at the query block's index",
           "as_blocks(k)[:, h, j], as_blocks(v)[:, h, j]  # [B",
           "as_blocks(k)[:, h, j], as_blocks(v)[:, h, i]  # [B",
           "check_forward", "the value blocks were gathered at the query block's index"),
    Mutant("each block's output summed into its key block's row", OUT,
           "index_add_(1, h * nb + j, p @ vg)\n", "check_forward", "the key block's row"),
    Mutant("the diagonal's mask hides the query's own key (triu(0))",
           "dtype=torch.bool, device=q.device).triu(1)",
           "dtype=torch.bool, device=q.device).triu(0)", "check_forward", "its own key"),
    Mutant("the output buffer made with the default dtype (float32)",
           "    out = torch.zeros(B, H * nb, block, d, dtype=q.dtype, device=q.device)",
           "    out = torch.zeros(B, H * nb, block, d, device=q.device)", "check_forward",
           "dtype=q.dtype"),
]
