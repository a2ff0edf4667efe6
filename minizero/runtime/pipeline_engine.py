"""minizero.runtime.pipeline_engine: the engine when `pipeline.stages` > 1 (DeepSpeed's PipelineEngine).

    engine, _, _, _ = minizero.initialize(model=model, config={
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
        "pipeline": {"stages": 2, "schedule": "1f1b"}, ...})
    for step in range(steps):
        loss = engine.train_batch(data_iter)   # m micro-batches through the pipeline, then the step

As in DeepSpeed, a pipeline step is one call: train_batch pulls gradient_accumulation_steps
micro-batches (= pipeline.micro_batches, m) of train_micro_batch_size_per_gpu samples from
`data_iter`, runs them through the schedule, reduces the gradients over the data-parallel ranks,
clips and steps. engine(x) / backward / step raise: the forward of one micro-batch is not a thing a
pipeline rank can do alone. The loss it returns is the batch's mean, on every rank.

Layout: Mesh(world, pp=stages, tp=t); the data-parallel size is world / (stages x t) and
train_batch_size = micro x m x dp is checked (config.py). `model` is a minizero.pipeline.PipelineModel
or has pipeline_parts() (TinyGPT); every rank keeps only its stage's blocks.
  tensor_parallel.autotp_size t > 1 (3D: dp x pp x tp): the model is split over mesh.tp first
    (tensor.TensorParallelGPT, no sequence parallelism), then cut into stages; the t ranks of a stage
    run the same schedule on the same micro-batches, each sending its copy of the hidden state to its
    own counterpart in the next stage (the pipes are per tp rank: mesh.pp joins equal tp coordinates).
    Feed every tp rank of a data-parallel rank the same data (engine.dp_rank, engine.dp_size).
  zero_optimization.stage 0 -> DDP of the stage over mesh.dp (reduced once per step: the runtime runs
    every backward but the last inside no_sync); 1 -> ShardedOptimizer of the stage over mesh.dp. 2 and 3
    are refused by the config, with the reason (config.PP_ZERO_MSG).
  gradient_clipping: the global norm over every stage (and ZeRO-1 shard); the tied embedding, which the
    first and last stage both hold after their all-reduce, is counted once; with TP a slice counts once
    and a tensor every tp rank holds whole counts 1/t per rank (runtime/trainer.py).
  The data-parallel strategy is the plain engine's (runtime/strategies.py) over the stage's parameters;
    counters, scheduler, accessors and the clip are the same TrainerCore (runtime/trainer.py).
  Checkpoints: each stage's ranks save its parameters under their plain names (tp slices as name@tp{k};
    the tied copy the last stage holds as name@pp{s}), so `consolidate` gives the plain model's state dict.
  activation_checkpointing: the stage's blocks run under torch.utils.checkpoint, as in the plain engine;
    ZB-H1's W pass recomputes a block a second time (after B), so the split keeps what it needs.
Not available with a pipeline (errors before any collective, runtime/resolve.py): fp16/bf16, offload,
sequence parallelism.
"""
from __future__ import annotations

import time

import torch

from minizero.comm import Mesh
from minizero.pipeline import PipelineModel, PipelineRuntime, PipelineStage
from minizero.runtime import chain
from minizero.runtime.resolve import Plan, pipeline_parts
from minizero.runtime.trainer import BaseEngine


def _named(model, parts) -> torch.nn.Module:
    """What names the parameters: the user's module, or the PipelineModel's parts under embed/blocks/head."""
    if isinstance(model, torch.nn.Module):
        return model
    return torch.nn.ModuleDict({"embed": parts.embed, "blocks": torch.nn.ModuleList(parts.blocks), "head": parts.head})


class PipelineEngine(BaseEngine):
    def __init__(self, model, plan: Plan, comm):
        super().__init__()                # an nn.Module, as DeepSpeed's engine (runtime/trainer.py)
        self.plan = plan                  # the resolved config (runtime/resolve.py)
        self.comm = comm                  # every rank of the job
        self.stage = plan.stage           # 0 or 1 (the config refuses 2 and 3)
        self.dtype, self.mixed_precision = torch.float32, False
        self.device = comm.device
        # dp x pp x tp; mesh.dp is what DeepSpeed calls the dp world
        self.mesh = Mesh(comm, pp=plan.pp_size, tp=plan.tp_size)
        if plan.tp_size > 1:  # 3D: split over mesh.tp first (in place), then cut into stages
            _, self.aliases, self.state_dict_keys, self.param_shapes = chain.model_names(model)
            model = chain.apply_tensor_parallel(model, plan, self.mesh)  # no SP (resolve refuses it)
            parts = PipelineModel(*model.pipeline_parts())
        else:
            parts = pipeline_parts(model)
            _, self.aliases, self.state_dict_keys, self.param_shapes = chain.model_names(_named(model, parts))
        named = _named(model, parts)
        chain.apply_sparse_attention(named, plan)
        self.name_of, _, _, _ = chain.model_names(named)
        self.tp_split = {n: [p.tensor_parallel_dim, p.tensor_parallel_chunks]  # how TP cut what it splits
                         for n, p in named.named_parameters(remove_duplicate=False)
                         if hasattr(p, "tensor_parallel_dim")}
        # activation_checkpointing: each block keeps only its input and recomputes its inside when its backward
        # needs it (B; a split schedule's W unpacks the same tensors, and torch recomputes for it again)
        self.checkpointed_blocks = chain.apply_activation_checkpointing(torch.nn.ModuleList(parts.blocks), plan)
        self.dp_comm = self.mesh.dp       # the data-parallel ranks of this stage
        self.dp_rank, self.dp_size = self.dp_comm.rank, self.dp_comm.size  # which rows of the batch are this rank's
        self._hold("pipeline", PipelineStage(parts, self.mesh, (plan.micro_batch_size, *parts.hidden_shape),
                                             num_chunks=plan.pipeline.chunks))  # this rank's part of module
        self.pipeline.to(self.device)
        self.module = model               # the plain model, as the user built it (split over tp in 3D)
        self.tied_names = {self.name_of[id(q)] for q in self.pipeline.tied} if not self.mesh.is_first_stage else set()
        self.local_shapes = {self.name_of[id(p)]: tuple(p.shape) for p in self.pipeline.parameters() if p.requires_grad}
        buffers = {id(b): n for n, b in named.named_buffers()}
        self._extras = {**{self.name_of[id(p)]: p for p in self.pipeline.parameters() if not p.requires_grad},
                        **{buffers[id(b)]: b for b in self.pipeline.buffers() if id(b) in buffers}}
        strategy = chain.select_strategy(plan, self.pipeline, self.dp_comm, runtime_syncs=True)
        self._attach(strategy, [self.mesh.pp] + ([self.mesh.tp] if self.mesh.tp_size > 1 else []))
        # DDP of the stage, whose no_sync the schedule drives (None: ZeRO-1 wraps nothing, nor one dp rank)
        self._hold("wrapped", strategy.wrapped if strategy.wrapped is not self.pipeline else None)
        self.runtime = PipelineRuntime(self.pipeline, plan.pipeline.schedule, plan.gradient_accumulation_steps,
                                       data_parallel=self.wrapped)
        self.timings = {"pipeline": 0.0, "step": 0.0}
        self.outputs = None

    def train(self, mode: bool = True):
        self.training = mode
        self.pipeline.train(mode)  # this rank's stage: the rest of the user's model is not here
        return self

    # ------------------------------------------------------------------ the loop
    def train_batch(self, data_iter=None):
        """One optimizer step over train_batch_size samples: m micro-batches (x, y) from data_iter
        through the pipeline. Returns the batch's mean loss on every rank (DeepSpeed's train_batch)."""
        m = self.gradient_accumulation_steps()
        t0 = time.perf_counter()
        batch = [next(data_iter) for _ in range(m)] if data_iter is not None else None
        x, y = (None, None) if batch is None else (torch.cat([b[0] for b in batch]).to(self.device),
                                                  torch.cat([b[1] for b in batch]).to(self.device))
        loss = self.runtime.step(x, y)
        t1 = time.perf_counter()
        self.apply_step(self.strategy.reduced_grads(), micro_steps=m)
        self.timings = {"pipeline": t1 - t0, "step": time.perf_counter() - t1}
        return self._batch_loss(loss)

    def _batch_loss(self, loss):
        """The last stage's mean over its micro-batches, averaged over dp, sent to every stage."""
        out = torch.zeros(1, device=self.device) if loss is None else loss.detach().reshape(1).clone()
        if self.mesh.is_last_stage:
            self.dp_comm.all_reduce(out, op="avg")
        self.mesh.pp.broadcast(out, src=self.mesh.pp_size - 1)
        return out[0]

    def __call__(self, *args, **kwargs):
        raise RuntimeError("with pipeline.stages > 1 a step is engine.train_batch(data_iter), as in DeepSpeed's "
                           "PipelineEngine: one rank cannot run a micro-batch's forward alone")

    forward = backward = step = __call__

    def weight_of(self):
        """name -> its weight in the global norm: 0 for the tied copy the first stage counts, 1/t for a
        tensor every tp rank holds whole, else 1 (runtime/trainer.py)."""
        t, split, tied = self.mesh.tp_size, self.tp_split, self.tied_names
        if t == 1 and not tied:
            return None  # every element counts once: no weights to build each step
        return lambda name: 0.0 if name in tied else 1.0 if t == 1 or name in split else 1.0 / t

    def extras(self) -> dict:
        return dict(self._extras)
