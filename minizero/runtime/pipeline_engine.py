"""minizero.runtime.pipeline_engine: the engine when `pipeline.stages` > 1 (DeepSpeed's PipelineEngine).

    engine, _, _, _ = minizero.initialize(model=model, config={
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2, "schedule": "1f1b"}, ...})
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

from minizero import memory
from minizero.activation_checkpointing import checkpoint_blocks
from minizero.comm import Mesh
from minizero.pipeline import PipelineModel, PipelineRuntime, PipelineStage
from minizero.runtime import checkpoint
from minizero.runtime.chain import model_names, strategy_part
from minizero.runtime.resolve import Plan, pipeline_parts
from minizero.runtime.strategies import STRATEGIES, norm_weights
from minizero.runtime.trainer import TrainerCore, shares_core


def _named(model, parts) -> torch.nn.Module:
    """What names the parameters: the user's module, or the PipelineModel's parts under embed/blocks/head."""
    if isinstance(model, torch.nn.Module):
        return model
    return torch.nn.ModuleDict({"embed": parts.embed, "blocks": torch.nn.ModuleList(parts.blocks), "head": parts.head})


@shares_core
class PipelineEngine:
    def __init__(self, model, plan: Plan, comm):
        cfg, pipe = plan.config, plan.config["pipeline"]
        self.plan = plan                  # the resolved config (runtime/resolve.py)
        self.world = comm                 # every rank of the job
        self.comm = comm                  # the same, as in Engine
        self.stage = plan.stage           # 0 or 1 (the config refuses 2 and 3)
        self.dtype, self.half = torch.float32, False
        self.device = comm.device
        self.offload = None               # refused with a pipeline (resolve.py)
        # dp x pp x tp; mesh.dp is what DeepSpeed calls the dp world
        self.mesh = Mesh(comm, pp=plan.pp_size, tp=plan.tp_size)
        if plan.tp_size > 1:  # 3D: split over mesh.tp first (in place), then cut into stages
            from minizero.tensor import TensorParallelGPT
            _, self.aliases, self.state_dict_keys, self.param_shapes = model_names(model)
            model = TensorParallelGPT(model, self.mesh.tp)
            parts = PipelineModel(*model.pipeline_parts())
        else:
            parts = pipeline_parts(model)
            _, self.aliases, self.state_dict_keys, self.param_shapes = model_names(_named(model, parts))
        named = _named(model, parts)
        self.name_of, _, _, _ = model_names(named)
        self.tp_split = {n: [p.tensor_parallel_dim, p.tensor_parallel_chunks]  # how TP cut what it splits
                         for n, p in named.named_parameters(remove_duplicate=False) if hasattr(p, "tensor_parallel_dim")}
        self.module = model               # the plain model, as the user built it (split over tp in 3D)
        # activation_checkpointing: each block keeps only its input and recomputes its inside when its backward
        # needs it (B; a split schedule's W unpacks the same tensors, and torch recomputes for it again)
        self.checkpointed_blocks = (checkpoint_blocks(torch.nn.ModuleList(parts.blocks))
                                    if cfg["activation_checkpointing"] is not None else [])
        self.dp_comm = self.mesh.dp       # the data-parallel ranks of this stage
        self.dp_rank, self.dp_size = self.dp_comm.rank, self.dp_comm.size  # which rows of the batch are this rank's
        micro = cfg["train_micro_batch_size_per_gpu"]
        self.pipeline = PipelineStage(parts, self.mesh, (micro, *parts.hidden_shape), num_chunks=pipe["chunks"])
        self.pipeline.to(self.device)
        self.tied_names = {self.name_of[id(q)] for q in self.pipeline.tied} if not self.mesh.is_first_stage else set()
        self.local_shapes = {self.name_of[id(p)]: tuple(p.shape) for p in self.pipeline.parameters() if p.requires_grad}
        buffers = {id(b): n for n, b in named.named_buffers()}
        self._extras = {**{self.name_of[id(p)]: p for p in self.pipeline.parameters() if not p.requires_grad},
                        **{buffers[id(b)]: b for b in self.pipeline.buffers() if id(b) in buffers}}
        part = strategy_part(plan, self.pipeline, self.dp_comm, runtime_syncs=True)
        self.strategy = STRATEGIES[plan.stage](self.pipeline, self.dp_comm, part)
        self.wrapped = getattr(self.strategy, "ddp", None)  # DDP of the stage (None: ZeRO-1, or one dp rank)
        self.optimizer = self.strategy.optimizer
        self.param_names = self.strategy.param_names(self.name_of)
        self.runtime = PipelineRuntime(self.pipeline, pipe["schedule"], cfg["gradient_accumulation_steps"],
                                       data_parallel=self.wrapped)
        self.core = TrainerCore(cfg, self.optimizer)
        self.timings = {"pipeline": 0.0, "step": 0.0}
        self.outputs = None

    def train(self, mode: bool = True):
        self.pipeline.train(mode)
        return self

    def eval(self):
        return self.train(False)

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
        grads = self.strategy.reduced_grads()
        if self.config["gradient_clipping"] > 0:
            self.clip(grads)
        self.strategy.apply()
        self.core.stepped(m)
        self.strategy.zero_grad()
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

    def clip(self, grads) -> float:
        weight_of = self.weight_of()
        weights = norm_weights(grads, self.strategy.grad_names(self.param_names) if weight_of else None, weight_of,
                               self.device)
        model_comms = [self.mesh.pp] + ([self.mesh.tp] if self.mesh.tp_size > 1 else [])
        return self.core.clip(grads, weights, self.world if self.strategy.shards else None,
                              model_comms if self.strategy.has_replicated else [])

    # ------------------------------------------------------------------ measurements
    def memory(self) -> memory.Ledger:
        return memory.measure(*self.strategy.memory_objects())

    def offload_traffic(self) -> dict:
        return {}

    def comm_stats(self) -> dict:
        return self.world.stats.as_dict()

    # ------------------------------------------------------------------ checkpoints (runtime/checkpoint.py)
    def save_checkpoint(self, save_dir, tag=None, client_state=None):
        """Every rank writes its stage's shard; a collective (Engine.save_checkpoint)."""
        return checkpoint.save(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir, tag=None):
        """-> (path, client_state); validates everything on every rank before changing anything."""
        return checkpoint.load(self, load_dir, tag)

    def full_state_dict(self) -> dict:
        """The plain model's state dict in fp32, on every rank (a collective)."""
        return checkpoint.full_state_dict(self)

    def checkpoint_layout(self) -> dict:
        return {"dp": self.dp_size, "pp": self.mesh.pp_size, "tp": self.mesh.tp_size, "tp_split": self.tp_split}

    def checkpoint_key(self, name: str) -> str:
        key = name if self.mesh.tp_size == 1 else f"{name}@tp{self.mesh.tp_rank}"
        return f"{key}@pp{self.mesh.pp_rank}" if name in self.tied_names else key

    def checkpoint_keys(self) -> list:
        return [(self.checkpoint_key(n), list(s)) for n, s in self.local_shapes.items()]

    def saves_extras(self) -> bool:
        return self.dp_comm.rank == 0 and self.mesh.tp_rank == 0

    def extras(self) -> dict:
        return dict(self._extras)
