"""minizero.sparse: block-sparse attention (Child et al. 2019; DeepSpeed's SparseSelfAttention).

    layout.py          the layouts as frozen configs with DeepSpeed's names (dense, fixed, variable,
                       bigbird, bslongformer): make_layout(seq_len) -> bool [heads, nb, nb];
                       from_section reads a DeepSpeed "sparse_attention" section (lab 14: the
                       layouts)
    attention.py       block_sparse_attention: only the kept blocks are gathered and computed, never
                       an n x n score matrix (lab 14); its score-byte and FLOP formulas; the dense
                       reference
    self_attention.py  a model's attention switched to it: apply_sparse_attention(model, config)
Measured: minizero_course/experiments/sparse.py.
"""
from minizero.sparse.attention import (attention_flops, block_sparse_attention,
                                       dense_attention_flops, dense_mask, dense_score_bytes,
                                       kept_blocks, masked_dense_attention, score_bytes)
from minizero.sparse.layout import (MODES, BigBirdSparsityConfig, BSLongformerSparsityConfig,
                                    DenseSparsityConfig, FixedSparsityConfig, SparsityConfig,
                                    VariableSparsityConfig, density, from_section)
from minizero.sparse.self_attention import (
    apply_sparse_attention,
    cached_layout,
    sparse_self_attention,
)

__all__ = ["MODES", "BSLongformerSparsityConfig", "BigBirdSparsityConfig", "DenseSparsityConfig",
           "FixedSparsityConfig", "SparsityConfig", "VariableSparsityConfig",
           "apply_sparse_attention", "attention_flops", "block_sparse_attention", "cached_layout",
           "dense_attention_flops", "dense_mask", "dense_score_bytes", "density", "from_section",
           "kept_blocks", "masked_dense_attention", "score_bytes", "sparse_self_attention"]
