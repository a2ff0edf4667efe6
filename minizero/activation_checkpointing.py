"""Activation checkpointing per block: keep each block's input, recompute its inside in backward.

Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": a block's forward runs without
keeping what autograd would save for backward; only its input is kept (one s·b·h tensor of w bytes
per layer instead of Korthikanti's s·b·h·(34 + 5·a·s/h) with w = 2, memory.activation_bytes), and
backward runs the block's forward again to get the rest back. Price: one more forward per block,
about a third more compute for a step whose backward costs twice its forward (the usual estimate
of about 33%; `python -m minizero_course bench --checkpointing` measures it).

    checkpoint_blocks(model)  # every element of every nn.ModuleList (TinyGPT: h.0, h.1, ...)
    checkpoint_blocks(model, ["h.0"])        # or the blocks you name
    checkpoint_blocks(model, granularity="selective")  # only each block's core attention
    uncheckpoint_blocks(model)               # back to plain forwards

Selective recomputation (Korthikanti et al. 2022, Sec. 5; Megatron-LM's `--recompute-granularity
selective`, whose `--recompute-modules` default is `core_attn`): keep everything the linear layers
produce, and recompute only the core attention, softmax(q·kᵀ/√d)·v, in backward. That part is
Korthikanti's 5·a·s/h term (the a·s² scores, softmax output and dropout), the larger the longer the
sequence, while its recompute costs only the two attention matmuls (no weights to multiply). A block
has a core attention when a submodule has a `core_attention(q, k, v)` method
(models.CausalSelfAttention); that bound method is replaced on the instance, as `forward` is for
full checkpointing. Under context parallelism TinyGPT's attention runs ring or Ulysses attention
instead, which selective leaves alone.

The recompute is torch's own (torch.utils.checkpoint, use_reentrant=False: a well-kept library,
and the non-reentrant form works with inputs that need no grad, kwargs and nested autograd). What
is ours is only where it goes: the block's `forward` attribute is replaced on the instance, so
module names, state_dict keys, named_parameters() and every hook stay as they were; any wrapper
(DDP, ZeRO, pipeline stages, tensor-parallel layers) sees the same module. During the recompute
the block is called again through its module call, so its forward hooks run again: a ZeRO-3 unit
gathers its parameters for the recompute exactly as it does for a plain forward.

Nothing here is random: the models have no dropout, so the recompute gives the same bits and the
gradients equal a plain run's exactly (tests/test_activation_checkpointing.py checks it).
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch.utils.checkpoint import checkpoint


class CheckpointedForward:
    """Replaces `module.forward`: the forward runs under torch.utils.checkpoint.

    Outside a recompute, the call is one checkpointed region around the module's own forward. The
    recompute (backward) calls the module again, hooks included, with `recomputing` set, so that
    call runs the plain forward."""

    def __init__(self, module: torch.nn.Module):
        self.module = module                # the block: called again (with its hooks) to recompute
        self.original = module.forward      # its own bound forward, put back by uncheckpoint_blocks
        self.recomputing = False            # True while backward re-runs this block
        self.recomputes = 0                 # how many times backward re-ran it (a test reads it)
        self.recompute_s = 0.0  # seconds spent re-running it (lesson 11 times the recompute)
        self.recompute_cpu_s = 0.0          # this thread's CPU seconds in it (lesson 11)

    def __call__(self, *args, **kwargs):
        if self.recomputing:
            return self.original(*args, **kwargs)
        return checkpoint(self._region, *args, use_reentrant=False, context_fn=self._contexts,
                          **kwargs)

    def _region(self, *args, **kwargs):
        if self.recomputing:  # through the module call: a ZeRO-3 unit's pre-hook gathers it again
            self.recomputes += 1
            return self.module(*args, **kwargs)
        return self.original(*args, **kwargs)

    def _contexts(self):
        # torch enters the second one for every recompute: a split backward (the pipeline's B, then
        # W) recomputes the same region twice, so it must
        # be re-enterable (a @contextmanager is single-use)
        return nullcontext(), _Recomputing(self)


class _Recomputing:
    """While torch recomputes a region: `forward.recomputing` is True (re-enterable). `forward`: a
    CheckpointedForward or a SelectiveCore."""

    def __init__(self, forward):
        self.forward = forward

    def __enter__(self):
        self.forward.recomputing = True
        self._t0, self._cpu0 = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc):
        # also reached when torch stops the recompute early, once it has every tensor backward needs
        self.forward.recompute_s += time.perf_counter() - self._t0
        # this thread's CPU seconds: what the recompute computed, without the waits for a core a
        # loaded machine adds
        self.forward.recompute_cpu_s += time.thread_time() - self._cpu0
        self.forward.recomputing = False


def repeated_blocks(model: torch.nn.Module) -> list[str]:
    """Names of the elements of every nn.ModuleList in `model`: the repeated blocks of a network."""
    return [f"{name}.{i}" if name else str(i) for name, module in model.named_modules()
            if isinstance(module, torch.nn.ModuleList) for i in range(len(module))]


GRANULARITIES = ("full", "selective")


def checkpoint_blocks(
    model: torch.nn.Module, blocks: list[str] | None = None, granularity: str = "full"
) -> list[str]:
    """Checkpoint each named block of `model` (default: repeated_blocks(model)); returns the names.
    granularity "full": the whole block, only its input kept; "selective": only the core attention
    inside it (every submodule's `core_attention`). A model without repeated blocks, a name it does
    not have, another granularity, or "selective" on a block without a core attention is a
    ValueError."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity {granularity!r}: expected one of {', '.join(GRANULARITIES)}")
    names = repeated_blocks(model) if blocks is None else list(blocks)
    if not names:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks to checkpoint: "
                         "name the blocks (checkpoint_blocks(model, ['layer1', ...]))")
    modules = []
    for name in names:
        try:
            modules.append(model.get_submodule(name))
        except AttributeError:
            raise ValueError(
                f"{type(model).__name__} has no submodule {name!r} to checkpoint"
            ) from None
    if granularity == "selective":
        cores = [
            [m for m in module.modules() if callable(getattr(m, "core_attention", None))]
            for module in modules
        ]
        if not all(cores):
            missing = [n for n, c in zip(names, cores) if not c]
            raise ValueError(f"{type(model).__name__}: blocks {missing} have no submodule with a "
                             "core_attention(q, k, v) to recompute selectively; use granularity "
                             "'full'")
        for attention in (m for found in cores for m in found):
            if not isinstance(attention.__dict__.get("core_attention"), SelectiveCore):
                attention.core_attention = SelectiveCore(attention.core_attention)
        return names
    for module in modules:
        if not isinstance(module.__dict__.get("forward"), CheckpointedForward):
            module.forward = CheckpointedForward(module)
    return names


class SelectiveCore:
    """Replaces an attention module's `core_attention`: it runs under torch.utils.checkpoint, so
    autograd keeps only q, k and v (the fused linear's output, kept anyway for c_attn's backward)
    and recomputes the scores, the mask and the softmax when backward reaches them."""

    def __init__(self, original):
        self.original = original            # the module's own bound core_attention
        self.recomputes = 0                 # how many times backward re-ran it (a test reads it)
        self.recompute_s = 0.0              # seconds spent re-running it (lesson 11 times it)
        self.recompute_cpu_s = 0.0          # this thread's CPU seconds in it (lesson 11)
        self.recomputing = False            # True while backward re-runs it

    def __call__(self, q, k, v):
        return checkpoint(self._region, q, k, v, use_reentrant=False, context_fn=self._contexts)

    def _region(self, q, k, v):
        if self.recomputing:
            self.recomputes += 1
        return self.original(q, k, v)

    def _contexts(self):
        return nullcontext(), _Recomputing(self)


def uncheckpoint_blocks(model: torch.nn.Module) -> None:
    """Undo checkpoint_blocks (either granularity): every block gets its own forward and core
    attention back."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), CheckpointedForward):
            del module.forward
        if isinstance(module.__dict__.get("core_attention"), SelectiveCore):
            del module.core_attention


def checkpointed(model: torch.nn.Module) -> dict:
    """name -> CheckpointedForward for every checkpointed block of `model`, and name ->
    SelectiveCore for every attention module whose core attention is recomputed selectively."""
    return {name: module.__dict__.get("forward", module.__dict__.get("core_attention"))
            for name, module in model.named_modules()
            if isinstance(module.__dict__.get("forward"), CheckpointedForward)
            or isinstance(module.__dict__.get("core_attention"), SelectiveCore)}
