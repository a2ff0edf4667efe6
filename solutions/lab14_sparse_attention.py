# Lab 14: Sparse attention: the fixed block layout and the block-sparse forward
# GENERATED from minizero/sparse/layout.py + minizero/sparse/attention.py by `make labs`. Edit nothing: this is the reference solution.
#   run:   mpirun -n 2 python solutions/lab14_sparse_attention.py
#   check: python -m minizero_course grade --lab 14 --impl solutions    (or: pytest -m lab14 --impl solutions)
"""Block-sparse attention layouts: which key blocks each query block attends to.

Child et al. 2019, "Generating Long Sequences with Sparse Transformers"; Zaheer et al. 2020,
BigBird; Beltagy et al. 2020, Longformer. The parameter names and the patterns are DeepSpeed's
(deepspeed/ops/sparse_attention/sparsity_config.py: each class's make_layout), so a DeepSpeed
"sparse_attention" config section means the same layout here (from_section).

A layout is a bool tensor [num_heads, nb, nb], nb = seq_len / block: layout[h, i, j] says that query
block i of head h computes its scores against key block j (block x block tokens). With
different_layout_per_head=False every head gets head 0's layout, as in DeepSpeed.

"unidirectional" (causal) layouts keep no block above the diagonal, except Variable's random blocks,
which DeepSpeed draws over the whole row in both modes; the attention drops those (every score in
them is a future token's). The random blocks (BigBird, Variable) come from a torch.Generator seeded
with `seed`, not Python's global `random` as in DeepSpeed: every rank builds the same layout from
the same config, which data and tensor parallelism need (a rank with other random blocks computes
other attention).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

ATTENTION = ("unidirectional", "bidirectional")


def _check(ok: bool, message: str):
    if not ok:
        raise ValueError(f"sparse_attention: {message}")


def _positive(name: str, value):
    _check(isinstance(value, int) and not isinstance(value, bool) and value > 0,
           f"{name} must be a positive integer, got {value!r}")


def _non_negative(name: str, value):
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
           f"{name} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class SparsityConfig:
    """What every layout shares: heads, the block size (tokens per side of a block) and whether each
    head gets a layout of its own."""
    num_heads: int
    block: int = 16
    different_layout_per_head: bool = False

    def __post_init__(self):
        _positive("num_heads", self.num_heads)
        _positive("block", self.block)
        _check(isinstance(self.different_layout_per_head, bool),
               "different_layout_per_head must be true or false, got "
               f"{self.different_layout_per_head!r}")
        if hasattr(self, "attention"):
            _check(self.attention in ATTENTION,
                   f"attention must be one of {ATTENTION}, got {self.attention!r}")

    @property
    def causal(self) -> bool:
        return getattr(self, "attention", "bidirectional") == "unidirectional"

    def num_blocks(self, seq_len: int) -> int:
        _check(seq_len % self.block == 0,
               f"the sequence length {seq_len} is not a multiple of block {self.block}")
        return seq_len // self.block

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The bool layout [num_heads, nb, nb] for a sequence of seq_len tokens."""
        nb = self.num_blocks(seq_len)
        heads = self.num_heads if self.different_layout_per_head else 1
        layout = torch.zeros(self.num_heads, nb, nb, dtype=torch.bool)
        generator = torch.Generator().manual_seed(getattr(self, "seed", 0))
        for h in range(heads):
            layout[h] = self.head_layout(h, nb, generator)
        if heads == 1:
            layout[1:] = layout[0]
        return layout

    def head_layout(self, h: int, nb: int, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class DenseSparsityConfig(SparsityConfig):
    """Every block kept (every block on or below the diagonal when unidirectional): dense attention
    in the block-sparse format, the baseline. DeepSpeed's has no `attention`; here it says causal or
    not."""
    attention: str = "bidirectional"

    def head_layout(self, h, nb, generator):
        square = torch.ones(nb, nb, dtype=torch.bool)
        return square.tril() if self.causal else square


def _random_blocks(layout, count, generator, causal):
    """`count` distinct random key blocks per query row (among 0..row when causal)."""
    nb = layout.shape[0]
    _check(count <= nb, f"num_random_blocks {count} is more than the {nb} blocks in a row")
    # random blocks (stretch): `count` distinct key blocks per row, drawn from `generator`.
    #   Every rank must draw the same ones: use the generator, never the global RNG. Causal: among 0..row.
    for row in range(nb):
        choices = row + 1 if causal else nb
        picked = torch.randperm(choices, generator=generator)[:count]
        layout[row, picked] = True


def _window(layout, start, end, causal):
    """A local window of blocks start..end-1 attending to each other (to earlier ones only when
    causal)."""
    square = torch.ones(end - start, end - start, dtype=torch.bool)
    layout[start:end, start:end] |= square.tril() if causal else square


@dataclass(frozen=True)
class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformer's "fixed" pattern: non-overlapping local windows of num_local_blocks, and
    in each window its last num_global_blocks blocks are global: every later query block (every
    query block when bidirectional) attends to them. horizontal_global_attention: the global blocks
    also attend to all. With different_layout_per_head, head h takes the global blocks (h mod
    num_different_global_patterns) steps earlier in each window."""
    num_local_blocks: int = 4
    num_global_blocks: int = 1
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = 1

    def __post_init__(self):
        super().__post_init__()
        _positive("num_local_blocks", self.num_local_blocks)
        _positive("num_global_blocks", self.num_global_blocks)
        _check(self.num_local_blocks % self.num_global_blocks == 0,
               f"num_local_blocks {self.num_local_blocks} must be a multiple of "
               f"num_global_blocks {self.num_global_blocks}")
        _check(not (self.horizontal_global_attention and self.attention != "bidirectional"),
               "horizontal_global_attention needs attention 'bidirectional'")
        _positive("num_different_global_patterns", self.num_different_global_patterns)
        _check(self.num_different_global_patterns == 1 or self.different_layout_per_head,
               "num_different_global_patterns > 1 needs different_layout_per_head true")
        _check(
            self.num_different_global_patterns <= self.num_local_blocks // self.num_global_blocks,
            f"num_different_global_patterns must be <= num_local_blocks / num_global_blocks "
            f"= {self.num_local_blocks // self.num_global_blocks}",
        )

    def head_layout(self, h, nb, generator):
        layout = torch.zeros(nb, nb, dtype=torch.bool)
        L, G = self.num_local_blocks, self.num_global_blocks
        # the fixed layout of head h: local windows, then the global blocks of each window.
        #   Windows of L blocks from block 0 (_window); the global blocks: the last G of each window (for head h,
        #   (h mod num_different_global_patterns) x G earlier), the short last window's clipped into the sequence.
        for start in range(0, nb, L):
            _window(layout, start, min(start + L, nb), self.causal)
        offset = L - (1 + h % self.num_different_global_patterns) * G  # first global block of a window
        full_windows_end = nb - nb % L
        starts = list(range(offset, full_windows_end, L))
        if full_windows_end < nb:  # a short last window: its global blocks, kept inside the sequence
            starts.append(min(full_windows_end + offset, nb - G))
        for g in starts:
            layout[g if self.causal else 0:, g:g + G] = True  # causal: only later query blocks see it
            if self.horizontal_global_attention:
                layout[g:g + G, :] = True
        return layout


@dataclass(frozen=True)
class VariableSparsityConfig(SparsityConfig):
    """Fixed with free sizes: local windows of local_window_blocks[0], [1], ... blocks (the last
    size repeats to the end), global blocks at global_block_indices (or the ranges [start, end) with
    global_block_end_indices), and num_random_blocks random key blocks per query row."""
    num_random_blocks: int = 0
    local_window_blocks: tuple = (4,)
    global_block_indices: tuple = (0,)
    global_block_end_indices: tuple | None = None
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False
    seed: int = 0

    def __post_init__(self):
        for name in ("local_window_blocks", "global_block_indices", "global_block_end_indices"):
            # a JSON list: frozen configs hold tuples (hashable)
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        super().__post_init__()
        _non_negative("num_random_blocks", self.num_random_blocks)
        _check(len(self.local_window_blocks) > 0,
               "local_window_blocks must list at least one window size")
        for w in self.local_window_blocks:
            _positive("local_window_blocks[i]", w)
        _check_global_ranges(self.global_block_indices, self.global_block_end_indices)
        _check(not (self.horizontal_global_attention and self.attention != "bidirectional"),
               "horizontal_global_attention needs attention 'bidirectional'")

    def head_layout(self, h, nb, generator):
        layout = torch.zeros(nb, nb, dtype=torch.bool)
        # DeepSpeed: whole row
        _random_blocks(layout, self.num_random_blocks, generator, causal=False)
        start = 0
        sizes = list(self.local_window_blocks)
        while start < nb:
            size = sizes.pop(0) if len(sizes) > 1 else sizes[0]
            _window(layout, start, min(start + size, nb), self.causal)
            start += size
        for g0, g1 in _global_ranges(self.global_block_indices, self.global_block_end_indices, nb):
            if self.horizontal_global_attention:
                layout[g0:g1, :] = True
            layout[g0 if self.causal else 0:, g0:g1] = True
        return layout


def _check_global_ranges(starts, ends):
    for g in starts:
        _non_negative("global_block_indices[i]", g)
    if ends is not None:
        _check(len(ends) == len(starts), f"global_block_end_indices has {len(ends)} entries, "
               f"global_block_indices {len(starts)}: they must pair up")
        for g0, g1 in zip(starts, ends):
            _check(g0 < g1,
                   f"global block range [{g0}, {g1}) is empty: each start must be below its end")


def _global_ranges(starts, ends, nb):
    """The [start, end) block ranges that are global, clipped to the sequence (out of range:
    ignored)."""
    ends = ends if ends is not None else [g + 1 for g in starts]
    return [(g0, min(g1, nb)) for g0, g1 in zip(starts, ends) if g0 < nb]


@dataclass(frozen=True)
class BigBirdSparsityConfig(SparsityConfig):
    """BigBird: a sliding window of num_sliding_window_blocks blocks centred on the diagonal, the
    first num_global_blocks blocks global (rows and columns), and num_random_blocks random key
    blocks per row."""
    num_random_blocks: int = 1
    num_sliding_window_blocks: int = 3
    num_global_blocks: int = 1
    attention: str = "bidirectional"
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        _non_negative("num_random_blocks", self.num_random_blocks)
        _positive("num_sliding_window_blocks", self.num_sliding_window_blocks)
        _positive("num_global_blocks", self.num_global_blocks)

    def head_layout(self, h, nb, generator):
        _check(self.num_sliding_window_blocks <= nb and self.num_global_blocks <= nb,
               f"num_sliding_window_blocks {self.num_sliding_window_blocks} and num_global_blocks "
               f"{self.num_global_blocks} must be at most the {nb} blocks of the sequence")
        layout = torch.zeros(nb, nb, dtype=torch.bool)
        _random_blocks(layout, self.num_random_blocks, generator, self.causal)
        _sliding_window(layout, self.num_sliding_window_blocks)
        layout[:self.num_global_blocks, :] = True
        layout[:, :self.num_global_blocks] = True
        return layout.tril() if self.causal else layout


def _sliding_window(layout, width):
    """Each query block sees the width // 2 blocks either side of it and itself."""
    nb, w = layout.shape[0], width // 2
    rows = torch.arange(nb)
    layout |= (rows[:, None] - rows[None, :]).abs() <= w


@dataclass(frozen=True)
class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer: a sliding window of num_sliding_window_blocks, and the global blocks
    at global_block_indices (or ranges with global_block_end_indices) attending to and attended by
    all."""
    num_sliding_window_blocks: int = 3
    global_block_indices: tuple = (0,)
    global_block_end_indices: tuple | None = None
    attention: str = "bidirectional"

    def __post_init__(self):
        for name in ("global_block_indices", "global_block_end_indices"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        super().__post_init__()
        _positive("num_sliding_window_blocks", self.num_sliding_window_blocks)
        _check_global_ranges(self.global_block_indices, self.global_block_end_indices)

    def head_layout(self, h, nb, generator):
        _check(self.num_sliding_window_blocks <= nb,
               f"num_sliding_window_blocks {self.num_sliding_window_blocks} "
               f"must be at most the {nb} blocks of the sequence")
        layout = torch.zeros(nb, nb, dtype=torch.bool)
        _sliding_window(layout, self.num_sliding_window_blocks)
        for g0, g1 in _global_ranges(self.global_block_indices, self.global_block_end_indices, nb):
            layout[g0:g1, :] = True
            layout[:, g0:g1] = True
        return layout.tril() if self.causal else layout


MODES = {"dense": DenseSparsityConfig, "fixed": FixedSparsityConfig,
         "variable": VariableSparsityConfig, "bigbird": BigBirdSparsityConfig,
         "bslongformer": BSLongformerSparsityConfig}


def from_section(section: dict, num_heads: int) -> SparsityConfig:
    """The config object for a DeepSpeed "sparse_attention" section ({"mode": "fixed", "block": 16,
    ...}). A key the mode does not take is an error naming the key and the keys allowed."""
    _check(isinstance(section, dict),
           f"the section must be a JSON object, got {type(section).__name__}")
    mode = section.get("mode", "fixed")
    _check(mode in MODES, f"mode must be one of {tuple(MODES)}, got {mode!r}")
    cls = MODES[mode]
    allowed = {f.name for f in fields(cls)} - {"num_heads"}
    for key in section:
        _check(key == "mode" or key in allowed,
               f"key {key!r} is not one of mode {mode!r}'s keys: {sorted(allowed | {'mode'})}")
    return cls(num_heads=num_heads, **{k: v for k, v in section.items() if k != "mode"})


def density(layout: torch.Tensor, causal: bool = False) -> float:
    """Kept blocks over all blocks (over the blocks on or below the diagonal when causal: the dense
    causal attention computes those)."""
    nb = layout.shape[-1]
    kept = layout.tril() if causal else layout
    total = layout.shape[0] * (nb * (nb + 1) // 2 if causal else nb * nb)
    return int(kept.sum()) / total


# ----------------------------------------------------------------------------- from minizero/sparse/attention.py
"""Block-sparse attention in plain torch: only the kept blocks of the layout are ever computed.

The layout's kept blocks are listed once, (h, i, j) for every layout[h, i, j] (nnz of them); query
block i and key/value block j of head h are gathered for each, so the scores are [batch, nnz, block,
block] (DeepSpeed's block-sparse "sdd" product has this shape: deepspeed/ops/sparse_attention/
matmul.py), never [batch, heads, n, n]. The softmax runs over a query row's blocks, which sit at
different places in that list: its maximum and its sum are reduced per row (scatter_reduce,
index_add), and the row's output is the sum of its blocks' P_ij V_j. The backward is written out
(_BlockSparseAttention) so that only q, k, v, the output and P are kept, not the gathered blocks.

Per layer, with b the batch, nnz the kept blocks over all heads, B the block, d the head size:
    score bytes   b·nnz·B²·bytes_per     (dense: b·heads·n²·bytes_per; the probabilities kept for
                  backward)
    FLOPs         4·b·nnz·B²·d            (Q·Kᵀ and P·V, forward; dense 4·b·heads·n²·d)
Dense causal attention computes every score and masks half of them; a causal layout keeps only
blocks on or below the diagonal, so a dense layout (all nb(nb+1)/2 of them) costs about half the
dense FLOPs. Kept for backward besides P: q, k, v and the output, 4·b·heads·n·d·bytes_per, as dense
attention keeps q, k, v. The gathered blocks (b·nnz·B·d each) live only inside forward and backward:
copies that the Triton kernels DeepSpeed uses avoid by reading the blocks in place.
"""

import math

import torch


def kept_blocks(layout: torch.Tensor, causal: bool):
    """(h, i, j) of the blocks attention computes, diagonal blocks first when causal (they alone
    need the token-level causal mask). Causal drops blocks above the diagonal: all their keys are
    future."""
    if causal:
        layout = layout.tril()
    h, i, j = layout.nonzero(as_tuple=True)
    if causal:
        order = torch.argsort((i != j).to(torch.int8), stable=True)
        h, i, j = h[order], i[order], j[order]
    return h, i, j


def check_layout(layout: torch.Tensor, heads: int, seq_len: int, block: int):
    """A layout fits these heads and tokens, and every query block sees its own block (so that every
    query, the first of a causal sequence too, has at least one key)."""
    if seq_len % block:
        raise ValueError(f"sparse_attention: the sequence length {seq_len} is not a multiple of "
                         f"block {block}")
    nb = seq_len // block
    if layout.shape != (heads, nb, nb):
        raise ValueError(f"sparse_attention: layout has shape {tuple(layout.shape)}, expected "
                         f"[heads, n/block, n/block] = [{heads}, {nb}, {nb}]")
    if not layout.diagonal(dim1=-2, dim2=-1).all():
        raise ValueError("sparse_attention: the layout leaves a query block without its own key "
                         "block")


def block_sparse_attention(q, k, v, layout: torch.Tensor, block: int, causal: bool,
                           scale: float = None):
    """softmax(q kᵀ · scale, masked by the layout (and causally)) v, for q, k, v [batch, heads, n,
    d] and a bool layout [heads, n/block, n/block]."""
    B, H, T, d = q.shape
    check_layout(layout, H, T, block)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    h, i, j = kept_blocks(layout.to(q.device), causal)
    return _BlockSparseAttention.apply(q, k, v, h, i, j, block, causal, scale)


def sparse_forward(q, k, v, h, i, j, block: int, causal: bool, scale: float):
    """(out [batch, heads, n, d], probabilities [batch, nnz, block, block]) for the kept blocks (h,
    i, j), the causal ones' diagonal blocks first (kept_blocks)."""
    B, H, T, d = q.shape
    nb = T // block
    as_blocks = lambda t: t.view(B, H, nb, block, d)  # noqa: E731
    # block-sparse forward: gather the kept blocks, scores per block, softmax per query row.
    #   Kept block n pairs query block i[n] with key/value block j[n] of head h[n]: scores [B, nnz, block, block].
    #   Causal: the first (i == j).sum() kept blocks are diagonal; mask their future keys. One softmax per query
    #   row over all its kept blocks (max and sum reduced per row h*nb + i); return out and the probabilities p.
    qg, kg, vg = as_blocks(q)[:, h, i], as_blocks(k)[:, h, j], as_blocks(v)[:, h, j]  # [B, nnz, block, d]
    scores = (qg @ kg.transpose(-2, -1)) * scale                                      # [B, nnz, block, block]
    if causal:  # a diagonal block: query t sees keys up to t only
        diagonal = int((i == j).sum())
        future = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)
        scores[:, :diagonal].masked_fill_(future, float("-inf"))
    row = h * nb + i  # which query row of blocks each kept block belongs to
    # The row maximum only keeps exp() in range: it cancels in the ratio.
    row_max = torch.full((B, H * nb, block), float("-inf"), dtype=q.dtype, device=q.device)
    row_max = row_max.scatter_reduce(1, row[None, :, None].expand(B, -1, block), scores.amax(-1), "amax")
    p = (scores - row_max[:, row, :, None]).exp_()
    row_sum = torch.zeros(B, H * nb, block, dtype=q.dtype, device=q.device).index_add_(1, row, p.sum(-1))
    p /= row_sum[:, row, :, None]
    out = torch.zeros(B, H * nb, block, d, dtype=q.dtype, device=q.device).index_add_(1, row, p @ vg)
    return out.view(B, H, T, d), p


class _BlockSparseAttention(torch.autograd.Function):
    """Keeps for backward only q, k, v, the output and the probabilities P (the kept blocks'): the
    gathered blocks are gathered again in backward, as FlashAttention recomputes rather than stores.
    Backward per kept block (FlashAttention's Algorithm 4 with D = rowsum(dO * O)):
        dV_j += Pᵀ dO_i    dP = dO_i V_jᵀ    dS = P * (dP - D_i)
        dQ_i += dS K_j · scale    dK_j += dSᵀ Q_i · scale"""

    @staticmethod
    def forward(ctx, q, k, v, h, i, j, block, causal, scale):
        out, p = sparse_forward(q, k, v, h, i, j, block, causal, scale)
        ctx.save_for_backward(q, k, v, out, p, h, i, j)
        ctx.block, ctx.scale = block, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, p, h, i, j = ctx.saved_tensors
        B, H, T, d = q.shape
        block, scale = ctx.block, ctx.scale
        nb = T // block
        as_blocks = lambda t: t.reshape(B, H, nb, block, d)  # noqa: E731
        # query block and key block of each kept block, over all heads
        rows, cols = h * nb + i, h * nb + j
        do_g = as_blocks(grad_out)[:, h, i]
        qg, kg, vg = as_blocks(q)[:, h, i], as_blocks(k)[:, h, j], as_blocks(v)[:, h, j]
        D = (grad_out * out).sum(-1).view(B, H * nb, block)
        dS = p * (do_g @ vg.transpose(-2, -1) - D[:, rows, :, None]) * scale
        zeros = lambda: torch.zeros(B, H * nb, block, d, dtype=q.dtype,  # noqa: E731
                                    device=q.device)
        dq = zeros().index_add_(1, rows, dS @ kg)
        dk = zeros().index_add_(1, cols, dS.transpose(-2, -1) @ qg)
        dv = zeros().index_add_(1, cols, p.transpose(-2, -1) @ do_g)
        return (dq.view(B, H, T, d), dk.view(B, H, T, d), dv.view(B, H, T, d),
                None, None, None, None, None, None)


def dense_mask(layout: torch.Tensor, block: int, causal: bool) -> torch.Tensor:
    """The token-level mask [heads, n, n] a layout means (True: the score is kept): what dense
    attention must mask to compute the same thing. The reference for tests and the lab's grader; n x
    n on purpose."""
    mask = layout.repeat_interleave(block, -2).repeat_interleave(block, -1)
    if causal:
        mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    return mask


def masked_dense_attention(q, k, v, mask: torch.Tensor, scale: float = None):
    """Dense attention with a token mask [heads, n, n]: the n x n reference."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def score_bytes(layout: torch.Tensor, batch: int, block: int, bytes_per: int, causal: bool) -> int:
    """The softmax probabilities block-sparse attention keeps for backward, one layer."""
    nnz = int((layout.tril() if causal else layout).sum())
    return batch * nnz * block * block * bytes_per


def dense_score_bytes(batch: int, heads: int, seq_len: int, bytes_per: int) -> int:
    """The same for dense attention: every head's n x n probabilities."""
    return batch * heads * seq_len * seq_len * bytes_per


def attention_flops(
    layout: torch.Tensor, batch: int, block: int, head_dim: int, causal: bool
) -> int:
    """Forward matmul FLOPs of block-sparse attention, one layer: Q·Kᵀ and P·V, 2·B²·d each per
    block."""
    nnz = int((layout.tril() if causal else layout).sum())
    return 4 * batch * nnz * block * block * head_dim


def dense_attention_flops(batch: int, heads: int, seq_len: int, head_dim: int) -> int:
    """Forward matmul FLOPs of dense attention (masked scores are computed all the same)."""
    return 4 * batch * heads * seq_len * seq_len * head_dim


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(14, globals())
