"""The engine's tensor parallelism: the dp x tp Mesh, the model split over mesh.tp, and the weights
that make a gradient norm count every element of the single-process model once.

`tensor_parallel.autotp_size = t` (DeepSpeed's key) makes the engine build `Mesh(world, tp=t)`: t
neighbouring ranks split every layer (minizero.tensor.TensorParallelGPT over mesh.tp) and see the
same micro-batch; the world / t tp groups are data parallel, and DDP or ZeRO-1/2/3 runs over mesh.dp
exactly as without TP (each dp rank holds the same slices). `tensor_parallel.sequence_parallel`
(a minizero key: Megatron's sequence parallelism, Korthikanti et al. 2022; DeepSpeed's
`sequence_parallel_size` is Ulysses, another method) splits the LayerNorm activations too.

Gradient clipping needs ||g|| of the whole model. Of each parameter TP splits, a rank holds its own
slice; of each one it keeps whole (LayerNorms, wpe, the row-parallel biases), a copy equal on the t
ranks of its group. So, with w = 1 on split elements and 1/t on whole ones,
    ||g||^2 = sum over the tp group of  sum_i w_i g_i^2
and ZeRO's sharding over dp adds up over dp as before: `norm_weights` gives every gradient tensor the
engine clips its weights, aligned element by element, ZeRO's flat shards included.
"""
from __future__ import annotations

import torch

from minizero.comm import Mesh
from minizero.runtime.config import ConfigError


def split_over_tp(engine_model, cfg: dict, comm):
    """-> (mesh or None, model): with autotp_size > 1, the model converted over mesh.tp (in place)."""
    tp = cfg["tensor_parallel"]["autotp_size"]
    if tp == 1:
        return None, engine_model
    from minizero.tensor import TensorParallelGPT
    mesh = Mesh(comm, tp=tp)
    return mesh, TensorParallelGPT(engine_model, mesh.tp, cfg["tensor_parallel"]["sequence_parallel"])


def check_model(model, cfg: dict):
    """Before any collective: TP needs a nanoGPT-named model built normally, no offload, and no SP under ZeRO-3."""
    tp = cfg["tensor_parallel"]
    if tp["autotp_size"] == 1:
        if tp["sequence_parallel"]:
            raise ConfigError("tensor_parallel.sequence_parallel needs tensor_parallel.autotp_size > 1")
        return
    missing = [n for n in ("wte", "wpe", "h", "ln_f", "lm_head") if not hasattr(model, n)]
    if missing:
        raise ConfigError(f"tensor_parallel.autotp_size={tp['autotp_size']} splits a nanoGPT-named model "
                          f"(wte, wpe, h.{{i}}.attn/mlp, ln_f, lm_head, as minizero.models.TinyGPT); "
                          f"{type(model).__name__} has no {', '.join(missing)}")
    zero = cfg["zero_optimization"]
    offloaded = [k for k in ("offload_optimizer", "offload_param") if zero[k]["device"] != "none"]
    if offloaded:  # the host optimizer's gradients and norm weights are not split-aware yet
        raise ConfigError(f"tensor_parallel.autotp_size={tp['autotp_size']} with zero_optimization."
                          f"{offloaded[0]}: offload with tensor parallelism is not implemented; set "
                          f"autotp_size 1 or the offload device to none")
    from minizero.zero.init import built_with_init
    if built_with_init(model) is not None:  # TensorParallelGPT slices real weights, not meta tensors
        raise ConfigError(f"tensor_parallel.autotp_size={tp['autotp_size']} with a model built under zero.Init: "
                          "tensor parallelism slices the built weights; build the model normally")
    if tp["sequence_parallel"] and zero["stage"] == 3:
        raise ConfigError("tensor_parallel.sequence_parallel with zero_optimization.stage 3: FSDP replaces the "
                          "parameters by flat shards, so the hooks that sum the LayerNorm gradients over the tp "
                          "group would be lost. Use stage 0, 1 or 2 with sequence parallelism, or turn it off")


def _weight(split: bool, tp_size: int) -> float:
    return 1.0 if split else 1.0 / tp_size


def norm_weights(engine, sharded: list, replicated: list) -> tuple[list, list]:
    """Per-element weights (1: split over tp, 1/t: whole on every tp rank) aligned with the engine's
    (sharded, replicated) gradient lists; None for all-ones (no TP)."""
    if engine.mesh is None:
        return [None] * len(sharded), [None] * len(replicated)
    t, opt, rank = engine.mesh.tp_size, engine.optimizer, engine.dp_comm.rank

    def flat(layout, is_split):  # weights of this rank's shard of a FlatLayout
        w = torch.zeros(layout.shard_numel, device=engine.device)
        for pc in layout.pieces(rank):
            w[pc.shard_lo:pc.shard_lo + pc.hi - pc.lo] = _weight(is_split(pc.index), t)
        return w
    if engine.stage == 0:
        params = [p for p in (opt.params if engine.half else engine.wrapped.params) if p.grad is not None]
        return [], [_weight(hasattr(p, "tensor_parallel_dim"), t) for p in params]
    if engine.stage in (1, 2):
        return [flat(opt.layout, lambda i: hasattr(opt.params[i], "tensor_parallel_dim"))], []
    split_names = engine.tp_split_names
    shards, wholes = [], []
    for u in engine.wrapped.units:
        is_split = [any(n in split_names for n in names) for _, _, names in u.entries]
        if u.shard is not None and engine.wrapped.unit_grad(u, "shard") is not None:  # FSDP's flat fp32 gradients
            shards.append(flat(u.layout, lambda i: is_split[i]))
        if u.whole is not None and engine.wrapped.unit_grad(u, "whole") is not None:
            wholes.append(torch.cat([torch.full((shape.numel(),), _weight(s, t), device=engine.device)
                                     for (shape, _, _), s in zip(u.entries[u.n_sharded:], is_split[u.n_sharded:])]))
    return shards, wholes
