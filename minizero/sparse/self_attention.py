"""Sparse attention inside a model: the layout a config gives, built once per sequence length, and
the switch that turns a model's attention modules to it (DeepSpeed's SparseSelfAttention keeps a
master layout the same way: deepspeed/ops/sparse_attention/sparse_self_attention.py, get_layout).

A module takes part by having a `sparse_attention` attribute (None: its dense attention) and calling
sparse_self_attention(q, k, v, config) when it is set; TinyGPT's CausalSelfAttention does.
"""
from __future__ import annotations

import functools

from minizero.sparse.attention import block_sparse_attention
from minizero.sparse.layout import SparsityConfig


@functools.lru_cache(maxsize=64)
def cached_layout(config: SparsityConfig, seq_len: int):
    """config.make_layout(seq_len), built once: configs are frozen, so equal configs share it."""
    return config.make_layout(seq_len)


def sparse_self_attention(q, k, v, config: SparsityConfig):
    """Block-sparse attention of q, k, v [batch, heads, n, d] under config's layout for n tokens. A
    module holding a slice of the heads (tensor parallelism) gets the first heads' layout when all
    heads share one; different layouts per head would need the rank's own heads, which it does not
    know here."""
    heads, n = q.shape[1], q.shape[2]
    layout = cached_layout(config, n)
    if heads != config.num_heads:
        if config.different_layout_per_head:
            raise ValueError(f"sparse_attention: different_layout_per_head with {heads} of "
                             f"{config.num_heads} heads on this rank (tensor parallelism) is not "
                             "supported; set it false")
        layout = layout[:heads]
    return block_sparse_attention(q, k, v, layout, config.block, config.causal)


def apply_sparse_attention(model, config: SparsityConfig | None, causal_model: bool = True) -> int:
    """Every attention module of `model` runs config's block-sparse attention from now on (None:
    back to dense). Returns how many modules it set. Refused, with nothing changed: a model without
    such modules, a bidirectional layout on a causal model (it would let tokens see the future), a
    head count unlike the model's, and context parallelism (its attention runs over the cp group;
    not composed here)."""
    modules = [m for m in model.modules() if hasattr(m, "sparse_attention")]
    if not modules:
        raise ValueError(f"sparse_attention: {type(model).__name__} has no attention module that "
                         "takes it")
    if config is not None:
        if not isinstance(config, SparsityConfig):
            raise ValueError("sparse_attention: expected a SparsityConfig, got "
                             f"{type(config).__name__}")
        if causal_model and not config.causal:
            raise ValueError("sparse_attention: attention must be 'unidirectional' for a causal "
                             f"model like {type(model).__name__}; got "
                             f"{getattr(config, 'attention', 'bidirectional')!r}")
        n_head = getattr(getattr(model, "config", None), "n_head", config.num_heads)
        if n_head != config.num_heads:
            raise ValueError(f"sparse_attention: num_heads {config.num_heads} is not the model's "
                             f"{n_head}")
        if any(getattr(m, "cp_comm", None) is not None for m in modules):
            raise ValueError("sparse_attention does not compose with context parallelism "
                             "(sequence_parallel_size > 1): use one or the other")
    for m in modules:
        m.sparse_attention = config
    return len(modules)
