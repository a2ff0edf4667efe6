"""Block-sparse attention (minizero/sparse): the layouts are DeepSpeed's, the attention equals dense
attention under the layout's mask (forward and gradients), and its score bytes and FLOPs are the
formulas'. One process, small tensors: about a second."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from minizero.memory import SavedTensors, activation_bytes
from minizero.models import GPTConfig, TinyGPT
from minizero.sparse import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                             FixedSparsityConfig, VariableSparsityConfig, apply_sparse_attention, attention_flops,
                             block_sparse_attention, dense_attention_flops, dense_mask, dense_score_bytes, density,
                             from_section, masked_dense_attention, score_bytes)


def rows(*lines):
    return torch.tensor([[c == "1" for c in line] for line in lines])


# Each expected layout was worked out by hand from DeepSpeed's make_layout
# (deepspeed/ops/sparse_attention/sparsity_config.py) for these parameters, one block per token.
DEEPSPEED_LAYOUTS = {
    # windows {0,1} {2,3} {4}; the last block of each window is global (1, 3), and the short last
    # window's global block is clipped into the sequence (4); bidirectional: whole global columns
    "fixed, bidirectional, 2 local": (
        FixedSparsityConfig(1, block=1, num_local_blocks=2), 5,
        rows("11011", "11011", "01111", "01111", "01011")),
    # windows of 4 under the diagonal; global columns 3 and 7 from their own row down; the short
    # window {8, 9}: global block min(8 + 3, 9) = 9
    "fixed, unidirectional, 4 local": (
        FixedSparsityConfig(1, block=1, num_local_blocks=4, attention="unidirectional"), 10,
        rows("1000000000", "1100000000", "1110000000", "1111000000", "0001100000",
             "0001110000", "0001111000", "0001111100", "0001000110", "0001000111")),
    # horizontal_global_attention: the global rows attend to everything too
    "fixed, horizontal global": (
        FixedSparsityConfig(1, block=1, num_local_blocks=2, horizontal_global_attention=True), 4,
        rows("1101", "1111", "0111", "1111")),
    # sliding window of 3 (one block either side) plus block 0 as global row and column; no random block
    "bigbird, no random": (
        BigBirdSparsityConfig(1, block=1, num_random_blocks=0), 5,
        rows("11111", "11100", "11110", "10111", "10011")),
    # sliding window of 3, global blocks 0 and 3 (rows and columns), then the lower triangle
    "bslongformer, unidirectional": (
        BSLongformerSparsityConfig(1, block=1, global_block_indices=[0, 3], attention="unidirectional"), 5,
        rows("10000", "11000", "11100", "11110", "10011")),
    # windows of 1, 2, then 2 repeated: {0} {1,2} {3,4} {5}; global column 0
    "variable, windows 1 then 2": (
        VariableSparsityConfig(1, block=1, local_window_blocks=[1, 2]), 6,
        rows("100000", "111000", "111000", "100110", "100110", "100001")),
    # global range [1, 3) given by end indices
    "variable, global range": (
        VariableSparsityConfig(1, block=1, local_window_blocks=[2], global_block_indices=[1],
                               global_block_end_indices=[3]), 4,
        rows("1110", "1110", "0111", "0111")),
}


@pytest.mark.parametrize("name", DEEPSPEED_LAYOUTS)
def test_layouts_are_deepspeeds(name):
    config, nb, expected = DEEPSPEED_LAYOUTS[name]
    layout = config.make_layout(nb * config.block)
    assert layout.shape == (1, nb, nb) and layout.dtype == torch.bool
    assert torch.equal(layout[0], expected), f"{name}:\n{layout[0].int()}"


def test_layouts_per_head_and_block_size():
    # two global patterns: head 0 takes the last block of each window of 2, head 1 the first
    config = FixedSparsityConfig(3, block=4, num_local_blocks=2, different_layout_per_head=True,
                                 num_different_global_patterns=2)
    layout = config.make_layout(16)
    assert torch.equal(layout[0], rows("1101", "1101", "0111", "0111"))
    assert torch.equal(layout[1], rows("1110", "1110", "1011", "1011"))
    assert torch.equal(layout[2], layout[0])  # head 2: pattern 2 mod 2 = 0
    shared = FixedSparsityConfig(3, block=4, num_local_blocks=2).make_layout(16)
    assert torch.equal(shared[1], shared[0]) and torch.equal(shared[0], layout[0])


def test_random_blocks_are_seeded_the_same_on_every_rank():
    a = BigBirdSparsityConfig(2, block=2, num_random_blocks=2, num_sliding_window_blocks=1, seed=7)
    # a second rank building the same config gets the same layout; another seed gets another one
    assert torch.equal(a.make_layout(64), BigBirdSparsityConfig(**vars(a)).make_layout(64))
    assert not torch.equal(a.make_layout(64), BigBirdSparsityConfig(**{**vars(a), "seed": 8}).make_layout(64))
    layout = a.make_layout(64)[0]
    fixed = BigBirdSparsityConfig(2, block=2, num_random_blocks=0, num_sliding_window_blocks=1).make_layout(64)[0]
    extra = (layout & ~fixed).sum(1)  # the random picks outside the diagonal and the global column
    assert torch.equal(layout & fixed, fixed) and (extra <= 2).all() and extra.sum() > 16
    causal = BigBirdSparsityConfig(1, block=2, num_random_blocks=2, attention="unidirectional").make_layout(64)[0]
    assert not causal.triu(1).any()


CONFIGS = {
    "fixed causal": FixedSparsityConfig(4, block=4, num_local_blocks=2, attention="unidirectional"),
    "fixed bidirectional": FixedSparsityConfig(4, block=4, num_local_blocks=2, horizontal_global_attention=True),
    "bigbird causal per head": BigBirdSparsityConfig(4, block=4, attention="unidirectional",
                                                     different_layout_per_head=True),
    "bigbird bidirectional": BigBirdSparsityConfig(4, block=4, num_random_blocks=2),
    "bslongformer": BSLongformerSparsityConfig(4, block=4, global_block_indices=[2]),
    # Variable's random blocks are drawn over the whole row even when causal: attention drops the future ones
    "variable causal": VariableSparsityConfig(4, block=4, num_random_blocks=2, local_window_blocks=[1, 2],
                                              attention="unidirectional"),
    "dense causal": DenseSparsityConfig(4, block=4, attention="unidirectional"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_equal_to_dense_attention_under_the_mask(name):
    config = CONFIGS[name]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    layout = config.make_layout(32)
    assert 0 < density(layout, config.causal) < 1 or name == "dense causal"
    out = block_sparse_attention(q, k, v, layout, config.block, config.causal)
    ref = masked_dense_attention(q, k, v, dense_mask(layout, config.block, config.causal))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-12)
    # the mask matters: without it the answer is another one
    assert name == "dense causal" or not torch.allclose(out, masked_dense_attention(
        q, k, v, dense_mask(torch.ones_like(layout), config.block, config.causal)))
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)


def test_score_bytes_and_flops_are_the_formulas():
    b, h, n, d, block = 2, 4, 128, 8, 16
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    for config in (FixedSparsityConfig(h, block=block, num_local_blocks=2, attention="unidirectional"),
                   BigBirdSparsityConfig(h, block=block, num_random_blocks=1)):
        layout = config.make_layout(n)
        with SavedTensors() as saved, FlopCounterMode(display=False) as flops:
            block_sparse_attention(q, k, v, layout, block, config.causal)
        # the scores kept for backward: the [b, nnz, block, block] probabilities, nothing n x n
        scores = [nbytes for shape, _, nbytes in saved.shapes["other"]
                  if shape[-2:] == (block, block) and len(shape) == 4]
        assert sum(scores) == score_bytes(layout, b, block, 4, config.causal)
        assert not [s for s, _, _ in saved.shapes["other"] if s[-2:] == (n, n)]
        # and besides them only q, k, v, the output and the kept blocks' (h, i, j): the gathers are redone in backward
        nnz = int((layout.tril() if config.causal else layout).sum())
        assert saved.total == score_bytes(layout, b, block, 4, config.causal) + 4 * b * h * n * d * 4 + 3 * nnz * 8
        assert flops.get_total_flops() == attention_flops(layout, b, block, d, config.causal)
        assert score_bytes(layout, b, block, 4, config.causal) < dense_score_bytes(b, h, n, 4)
        # the estimator, told the layout's kept scores, differs from dense by exactly the scores not kept
        kept = score_bytes(layout, 1, block, 1, config.causal)
        assert activation_bytes(b, n, h * d, 1, h, 4, dropout=False) - activation_bytes(
            b, n, h * d, 1, h, 4, dropout=False, attention_scores=kept) == dense_score_bytes(b, h, n, 4) - score_bytes(
            layout, b, block, 4, config.causal)
    with SavedTensors() as saved, FlopCounterMode(display=False) as flops:
        masked_dense_attention(q, k, v, torch.ones(h, n, n, dtype=torch.bool))
    assert sum(nb for s, dt, nb in saved.shapes["other"] if s == (b, h, n, n) and "float" in dt) == \
        dense_score_bytes(b, h, n, 4)
    assert flops.get_total_flops() == dense_attention_flops(b, h, n, d)


def _model(seed=0):
    return TinyGPT(GPTConfig(block_size=32, n_head=4, n_embd=32), seed=seed)


def test_tinygpt_runs_sparse_attention_and_refuses_what_does_not_fit():
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    dense, sparse = _model(), _model()
    logits, loss = dense(idx, idx)
    loss.backward()
    # a dense layout in the block-sparse format: the same model, the same numbers
    assert apply_sparse_attention(sparse, DenseSparsityConfig(4, block=8, attention="unidirectional")) == 2
    s_logits, s_loss = sparse(idx, idx)
    s_loss.backward()
    torch.testing.assert_close(s_logits, logits, rtol=1e-5, atol=1e-6)
    for (name, p), ps in zip(dense.named_parameters(), sparse.parameters()):
        torch.testing.assert_close(ps.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # a sparse layout changes the answer; None switches back to the dense path
    apply_sparse_attention(sparse, FixedSparsityConfig(4, block=8, num_local_blocks=2, attention="unidirectional"))
    assert (sparse(idx)[0] - logits).abs().max() > 1e-4  # the dense layout's difference: under 1e-6
    apply_sparse_attention(sparse, None)
    assert torch.equal(sparse(idx)[0], logits)
    for bad, words in ((FixedSparsityConfig(4, block=8), "attention must be 'unidirectional'"),
                       (FixedSparsityConfig(2, block=8, attention="unidirectional"), "num_heads 2")):
        with pytest.raises(ValueError, match=words):
            apply_sparse_attention(sparse, bad)
        assert all(b.attn.sparse_attention is None for b in sparse.h)  # refused: nothing changed
    apply_sparse_attention(sparse, FixedSparsityConfig(4, block=8, attention="unidirectional"))
    with pytest.raises(ValueError, match="context parallelism"):
        sparse.set_context_parallel(object(), "ring")
    with pytest.raises(ValueError, match="multiple of block 8"):
        sparse(idx[:, :12])


@pytest.mark.parametrize("section, words", [
    ({"mode": "sparse"}, "mode must be one of"),
    ({"mode": "fixed", "num_random_blocks": 1}, "'num_random_blocks' is not one of mode 'fixed'"),
    ({"mode": "bigbird", "attention": "causal"}, "attention must be one of"),
    ({"mode": "fixed", "block": 0}, "block must be a positive integer"),
    ({"mode": "fixed", "num_local_blocks": 3, "num_global_blocks": 2}, "multiple of num_global_blocks"),
    ({"mode": "bslongformer", "global_block_indices": [0, 2], "global_block_end_indices": [1]}, "pair up"),
])
def test_a_deepspeed_section_is_read_or_refused_by_name(section, words):
    with pytest.raises(ValueError, match=words):
        from_section(section, num_heads=4)


def test_a_deepspeed_section_builds_its_config():
    config = from_section({"mode": "bigbird", "block": 16, "num_random_blocks": 2, "num_sliding_window_blocks": 3,
                           "num_global_blocks": 1, "attention": "unidirectional",
                           "different_layout_per_head": True}, num_heads=4)
    assert config == BigBirdSparsityConfig(4, 16, True, 2, 3, 1, "unidirectional")
    assert from_section({"mode": "variable", "local_window_blocks": [4, 2]}, 2).local_window_blocks == (4, 2)
