"""DeepSpeed's `deepspeed.pipe`: PipelineModule and LayerSpec on minizero's pipeline
(minizero.pipeline).

    from minizero.pipe import PipelineModule, LayerSpec  # DeepSpeed: from deepspeed.pipe import ...
    net = PipelineModule(layers=[LayerSpec(Embed, V, d), *[LayerSpec(Block, d) for _ in range(4)],
                                 LayerSpec(Head, d, V)],
                         num_stages=2, loss_fn=nn.CrossEntropyLoss())
    engine, _, _, _ = minizero.initialize(model=net, config={...})
    loss = engine.train_batch(data_iter)                       # data_iter yields (inputs, labels)

How the layer list maps onto minizero's PipelineModel (pipeline/stage.py): the layers are cut into
num_stages runs as DeepSpeed cuts them (partition_method 'parameters': the trainable parameter
counts balanced by DeepSpeed's solver; 'uniform': equal layer counts); the first layer is the embed,
the last the head, the layers between the blocks, and stage s holds the blocks of its run. What
crosses between stages may change shape from layer to layer: without `hidden_shape` (a minizero
keyword, one sample's shape when it is the same everywhere) the stages learn shape and dtype at the
first step, from one metadata message per pipe, as DeepSpeed's PipelineEngine does. num_stages is
the engine's stage count, as in DeepSpeed (the config needs no pipeline section; a pipeline.stages
that differs is an error).
The engine then has DeepSpeed's PipelineEngine names: train_batch(data_iter=None) (None:
initialize's training_data, in order, repeating), eval_batch(data_iter), num_stages, stage_id,
micro_batches, is_first_stage(), is_last_stage(), set_dataiterator() (runtime/pipeline_engine.py).
A callable that is not a module (DeepSpeed allows `lambda x: x.view(...)`) runs as a layer without
parameters. Refused with a clear error: TiedLayerSpec, topology, seed_layers, dynamic_shape,
activation_checkpoint_interval > 0 (use the config's "activation_checkpointing" section),
partition_method other than 'parameters' / 'uniform'.
Outside a pipeline (pipeline.stages 1), the module's forward runs every layer in order.
"""
from __future__ import annotations

from typing import Callable

import torch.nn as nn


class LayerSpec:
    """A layer's class and arguments, built when the PipelineModule is (DeepSpeed builds only its
    stage's)."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self):
        return f"LayerSpec({self.typename.__name__})"

    def build(self, log=False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    def __init__(self, key, typename, *module_args, **module_kwargs):
        raise NotImplementedError("TiedLayerSpec is not implemented by minizero's PipelineModule: "
                                  "tie the weights in your own model and give it pipeline_parts() "
                                  "(TinyGPT's way, docs/pipeline.md)")


class _Function(nn.Module):
    """A plain callable in the layer list (DeepSpeed allows `lambda x: x.view(...)`)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class PipelineModule(nn.Module):
    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False,
                 seed_fn=None, base_seed=1234, partition_method="parameters",
                 activation_checkpoint_interval=0, activation_checkpoint_func=None,
                 checkpointable_layers=None, dynamic_shape=False, *, hidden_shape=None):
        super().__init__()
        for name, bad in (("topology", topology is not None), ("seed_layers", bool(seed_layers)),
                          ("seed_fn", seed_fn is not None), ("dynamic_shape", bool(dynamic_shape)),
                          ("activation_checkpoint_interval", activation_checkpoint_interval != 0)):
            if bad:
                raise ValueError(f"PipelineModule: {name} is not implemented by minizero; leave it "
                                 "at DeepSpeed's default (activation checkpointing: the config's "
                                 "\"activation_checkpointing\" section)")
        if str(partition_method).lower() not in ("parameters", "uniform"):
            raise ValueError(f"PipelineModule: partition_method {partition_method!r} is not "
                             "implemented: minizero cuts the blocks into runs of equal count; use "
                             "'uniform' (or 'parameters' for equal blocks)")
        if num_stages is None or num_stages < 1:
            raise ValueError("PipelineModule: give num_stages (a positive int; topology= is not "
                             "implemented)")
        layers = [layer.build() if isinstance(layer, LayerSpec) else layer for layer in layers]
        layers = [layer if isinstance(layer, nn.Module) else _Function(layer) for layer in layers]
        if len(layers) < 3:
            raise ValueError("PipelineModule: minizero needs at least 3 layers (first: embed, "
                             f"last: head, blocks between), got {len(layers)}")
        for i, layer in enumerate(layers):
            self.add_module(str(i), layer)  # DeepSpeed's parameter names: "<index>.<name>"
        self._layers = layers  # the stage order; loss_fn (often a module) is not one of them
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        # optional: one sample's shape between the layers; None (DeepSpeed's way) learns it at the
        # first step
        self.hidden_shape = None if hidden_shape is None else tuple(hidden_shape)

    def forward(self, x):
        for layer in self._layers:
            x = layer(x)
        return x

    def pipeline_parts(self):
        """This model as minizero.pipeline cuts it (module docstring); the engine calls it."""
        from minizero.pipeline import PipelineModel
        from minizero.runtime.config import ConfigError
        if self.loss_fn is None:
            raise ConfigError("PipelineModule: give loss_fn= (loss_fn(outputs, labels)): the last "
                              "stage computes the loss")
        layers = self._layers
        # stage s holds layers [parts[s], parts[s+1]); layer 0 is the embed and layer i the block i
        # - 1
        parts = self.stage_parts()
        blocks = len(layers) - 2
        stage_blocks = [range(min(max(lo - 1, 0), blocks), min(max(hi - 1, 0), blocks))
                        for lo, hi in zip(parts[:-1], parts[1:])]
        return PipelineModel(layers[0], layers[1:-1], layers[-1], self.loss_fn, self.hidden_shape,
                             stage_blocks)

    def stage_parts(self) -> list[int]:
        """DeepSpeed's cut of the layer list (PipelineModule._partition_layers): 'uniform', equal
        layer counts; 'parameters', the trainable parameter counts balanced by its linear-partition
        solver."""
        if str(self.partition_method).lower() == "uniform":
            return _partition_uniform(len(self._layers), self.num_stages)
        counts = [sum(p.numel() for p in layer.parameters() if p.requires_grad)
                  for layer in self._layers]
        return _partition_balanced(counts, self.num_stages)


def _partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """deepspeed.runtime.utils.partition_uniform: equal parts, the first `residual` one longer."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, residual = divmod(num_items, num_parts)
    return [p * size + min(p, residual) for p in range(num_parts + 1)]


def _partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """deepspeed.runtime.utils.partition_balanced, the same solver with the same ties: contiguous
    parts whose largest and smallest sums differ least (dynamic programming over (items, parts))."""
    n, m = len(weights), num_parts
    if n <= m:
        return _partition_uniform(n, m)
    inf = float("inf")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    big = [[inf] * (m + 1) for _ in range(n + 1)]
    small = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    big[0][0] = cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(big[k][j - 1], part), min(small[k][j - 1], part)
                if cost[i][j] >= hi - lo:  # >=: the last k wins a tie, as in DeepSpeed
                    cost[i][j], big[i][j], small[i][j], position[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][j])
    return parts[::-1]
