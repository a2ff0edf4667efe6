"""minizero.runtime.pipeline_engine: the engine when `pipeline.stages` > 1 (DeepSpeed's PipelineEngine).

    engine = minizero.initialize(model, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
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
    and a tensor every tp rank holds whole counts 1/t per rank (runtime/tensor_parallel.py).
  activation_checkpointing: the stage's blocks run under torch.utils.checkpoint, as in the plain engine;
    ZB-H1's W pass recomputes a block a second time (after B), so the split keeps what it needs.
Not available with a pipeline (errors before any collective): fp16/bf16, offload, sequence parallelism,
checkpoints.
"""
from __future__ import annotations

import time

import torch

from minizero import memory
from minizero.comm import Mesh
from minizero.pipeline import PipelineModel, PipelineRuntime, PipelineStage
from minizero.pipeline.stage import partition
from minizero.runtime.config import ConfigError
from minizero.runtime.engine import Engine, _checkpoint, optimizer_spec
from minizero.runtime.schedulers import build_scheduler


def check_pipeline(cfg: dict):
    """What the pipeline engine cannot do with a valid config, before any collective."""
    for section in ("fp16", "bf16"):
        if cfg[section]["enabled"]:
            raise ConfigError(f"{section} with pipeline.stages > 1: not available; the pipeline runs in fp32 "
                              f"(set {section}.enabled false, or pipeline.stages 1)")
    if cfg["tensor_parallel"]["sequence_parallel"]:
        raise ConfigError("tensor_parallel.sequence_parallel with pipeline.stages > 1: not implemented (the pipes "
                          "carry the whole sequence between stages); set sequence_parallel false or stages 1")
    zero = cfg["zero_optimization"]
    for section in ("offload_optimizer", "offload_param"):
        if zero[section]["device"] != "none":
            raise ConfigError(f"zero_optimization.{section}.device {zero[section]['device']!r} with pipeline.stages > 1: "
                              "not available; the pipeline engine keeps each stage's optimizer on the device "
                              f"(set {section}.device 'none', or pipeline.stages 1)")


def pipeline_parts(model) -> PipelineModel:
    if isinstance(model, PipelineModel):
        return model
    if hasattr(model, "pipeline_parts"):
        return model.pipeline_parts()
    raise ConfigError(f"pipeline.stages > 1 needs a model cut into stages: a minizero.pipeline.PipelineModel "
                      f"(embed, blocks, head, loss_fn, hidden_shape) or a model with pipeline_parts() (TinyGPT has "
                      f"one); got a {type(model).__name__}")


class PipelineEngine(Engine):
    def __init__(self, model, cfg: dict, comm):
        pipe, zero = cfg["pipeline"], cfg["zero_optimization"]
        tp_size = cfg["tensor_parallel"]["autotp_size"]
        if tp_size > 1:  # 3D: checked before the mesh (a collective) and the split (in place)
            from minizero.runtime.tensor_parallel import check_model
            from minizero.tensor import TensorParallelGPT
            check_model(model, cfg)
            TensorParallelGPT.check(model, tp_size)  # heads, hidden, vocabulary divisible by t
            partition(len(model.h), pipe["stages"], pipe["chunks"])  # more stages than blocks, uneven chunks
            blocks = list(model.h)
        else:
            parts = pipeline_parts(model)
            if parts.hidden_shape is None:
                raise ConfigError("the PipelineModel has no hidden_shape: give one sample's hidden state shape, "
                                  "e.g. (T, n_embd), so stages can allocate what they receive")
            blocks = parts.blocks
        sizes = {sum(p.numel() for p in b.parameters()) for b in blocks}
        if pipe["partition"] == "parameters" and len(sizes) > 1:
            raise ConfigError(f"pipeline.partition 'parameters': the blocks hold {sorted(sizes)} parameters; minizero "
                              "cuts by block count, which balances parameters only for equal blocks: use 'uniform'")
        self.config = cfg                 # the checked config
        self.world = comm                 # every rank of the job
        # dp x pp x tp; mesh.dp is what DeepSpeed calls the dp world
        self.mesh = Mesh(comm, pp=pipe["stages"], tp=tp_size)
        if tp_size > 1:
            model = TensorParallelGPT(model, self.mesh.tp)  # in place: the user's module holds its slices now
            parts = PipelineModel(*model.pipeline_parts())
        # activation_checkpointing: each block keeps only its input and recomputes its inside when its backward
        # needs it (B; a split schedule's W unpacks the same tensors, and torch recomputes for it again)
        self.checkpointed_blocks = (_checkpoint(torch.nn.ModuleList(parts.blocks))
                                    if cfg["activation_checkpointing"] is not None else [])
        self.comm = self.mesh.dp          # the data-parallel ranks (as Engine.comm)
        self.dp_rank, self.dp_size = self.comm.rank, self.comm.size  # which rows of the batch are this rank's
        self.module = model               # the plain model, as the user built it
        self.stage = zero["stage"]        # 0 or 1 (the config refuses 2 and 3)
        self.dtype, self.half = torch.float32, False
        self.device = comm.device
        micro = cfg["train_micro_batch_size_per_gpu"]
        self.pipeline = PipelineStage(parts, self.mesh, (micro, *parts.hidden_shape), num_chunks=pipe["chunks"])
        self.pipeline.to(self.device)
        cls, kw = optimizer_spec(cfg["optimizer"])
        params = [p for p in self.pipeline.parameters() if p.requires_grad]
        self.wrapped = None
        if self.stage == 0:
            from minizero.dp.ddp import DDP
            if self.mesh.dp_size > 1:
                self.wrapped = DDP(self.pipeline, self.comm, bucket_numel=int(zero["reduce_bucket_size"]),
                                   overlap=zero["overlap_comm"])
            self.optimizer = cls(params, **kw)
        else:
            from minizero.zero.sharded_optimizer import ShardedOptimizer
            self._broadcast([p for p in self.pipeline.parameters() if not p.requires_grad]
                            + list(self.pipeline.buffers()))
            self.optimizer = ShardedOptimizer(params, cls, self.comm, **kw)
        self.runtime = PipelineRuntime(self.pipeline, pipe["schedule"], cfg["gradient_accumulation_steps"],
                                       data_parallel=self.wrapped)
        self.loss_scaler = None
        self.lr_scheduler = build_scheduler(self.optimizer, cfg["scheduler"])
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self.overflow, self.grad_norm, self.outputs, self._shard_grad = False, None, None, None
        self.timings = {"pipeline": 0.0, "step": 0.0}

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
        if self.config["gradient_clipping"] > 0:
            self.grad_norm = self._clip(self.config["gradient_clipping"])
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad()
        self.micro_steps += m
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.timings = {"pipeline": t1 - t0, "step": time.perf_counter() - t1}
        return self._batch_loss(loss)

    def _batch_loss(self, loss):
        """The last stage's mean over its micro-batches, averaged over dp, sent to every stage."""
        out = torch.zeros(1, device=self.device) if loss is None else loss.detach().reshape(1).clone()
        if self.mesh.is_last_stage:
            self.comm.all_reduce(out, op="avg")
        self.mesh.pp.broadcast(out, src=self.mesh.pp_size - 1)
        return out[0]

    def __call__(self, *args, **kwargs):
        raise RuntimeError("with pipeline.stages > 1 a step is engine.train_batch(data_iter), as in DeepSpeed's "
                           "PipelineEngine: one rank cannot run a micro-batch's forward alone")

    forward = backward = step = __call__

    @torch.no_grad()
    def _clip(self, max_norm):
        """Global L2 norm over all stages (and ZeRO-1 shards, and tp slices), tied weights once; torch's
        coefficient. A tensor every tp rank holds whole is weighted 1/t on each (runtime/tensor_parallel.py)."""
        tied = {id(q) for q in self.pipeline.tied} if not self.mesh.is_first_stage else set()
        t = self.mesh.tp_size
        weight = lambda p: 1.0 if t == 1 or hasattr(p, "tensor_parallel_dim") else 1.0 / t  # noqa: E731
        sq = torch.zeros(1, device=self.device)
        if self.stage == 0:
            grads = [p.grad for p in self.optimizer.param_groups[0]["params"] if p.grad is not None]
            for p in self.optimizer.param_groups[0]["params"]:
                if p.grad is not None and id(p) not in tied:  # the last stage's copy of a tied weight: once
                    sq += p.grad.pow(2).sum() if t == 1 else weight(p) * p.grad.pow(2).sum()
            self.mesh.pp.all_reduce(sq, op="sum")  # replicated over dp: add the stages only
            if t > 1:
                self.mesh.tp.all_reduce(sq, op="sum")  # and the tp slices of each stage
        else:
            opt = self.optimizer
            shard = opt.reduce_gradients()
            grads = [shard]
            if t == 1:
                sq += shard.pow(2).sum()
            for piece in opt.layout.pieces(self.comm.rank):
                p, part = opt.params[piece.index], shard[piece.shard_lo:piece.shard_lo + piece.hi - piece.lo]
                if t == 1 and id(p) in tied:
                    sq -= part.pow(2).sum()
                elif t > 1 and id(p) not in tied:
                    sq += weight(p) * part.pow(2).sum()
            self.world.all_reduce(sq, op="sum")  # every rank holds a different piece: dp shards x stages x tp
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s formula
        for g in grads:
            g.mul_(coef)
        return norm.item()

    # ------------------------------------------------------------------ measurements
    def memory(self) -> memory.Ledger:
        return memory.measure(self.wrapped or self.pipeline, self.optimizer)

    def comm_stats(self) -> dict:
        return self.world.stats.as_dict()

    def save_checkpoint(self, *args, **kwargs):
        raise NotImplementedError("checkpoints of a pipeline engine are not available: each stage would write its "
                                  "own blocks; save the stages' state_dicts yourself (engine.pipeline)")

    load_checkpoint = full_state_dict = save_checkpoint
