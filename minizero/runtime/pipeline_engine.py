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

Layout: Mesh(world, pp=stages); the data-parallel size is world / stages and train_batch_size =
micro x m x dp is checked (config.py). `model` is a minizero.pipeline.PipelineModel or has
pipeline_parts() (TinyGPT); every rank keeps only its stage's blocks.
  zero_optimization.stage 0 -> DDP of the stage over mesh.dp (reduced once per step: the runtime runs
    every backward but the last inside no_sync); 1 -> ShardedOptimizer of the stage over mesh.dp. 2 and 3
    are refused by the config, with the reason (config.PP_ZERO_MSG).
  gradient_clipping: the global norm over every stage (and ZeRO-1 shard); the tied embedding, which the
    first and last stage both hold after their all-reduce, is counted once.
Not available with a pipeline (errors before any collective): fp16/bf16, offload, tensor parallelism
(3D), checkpoints.
"""
from __future__ import annotations

import time

import torch

from minizero import memory
from minizero.comm import Mesh
from minizero.pipeline import PipelineModel, PipelineRuntime, PipelineStage
from minizero.runtime.config import ConfigError
from minizero.runtime.engine import Engine, optimizer_spec
from minizero.runtime.schedulers import build_scheduler


def check_pipeline(cfg: dict):
    """What the pipeline engine cannot do with a valid config, before any collective."""
    for section in ("fp16", "bf16"):
        if cfg[section]["enabled"]:
            raise ConfigError(f"{section} with pipeline.stages > 1: not available; the pipeline runs in fp32 "
                              f"(set {section}.enabled false, or pipeline.stages 1)")
    if cfg["tensor_parallel"]["autotp_size"] > 1:
        raise ConfigError("pipeline.stages > 1 with tensor_parallel.autotp_size > 1 (3D parallelism): not available "
                          "yet; use one of them (set pipeline.stages 1, or tensor_parallel.autotp_size 1)")
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
        parts = pipeline_parts(model)
        if parts.hidden_shape is None:
            raise ConfigError("the PipelineModel has no hidden_shape: give one sample's hidden state shape, "
                              "e.g. (T, n_embd), so stages can allocate what they receive")
        sizes = {sum(p.numel() for p in b.parameters()) for b in parts.blocks}
        if pipe["partition"] == "parameters" and len(sizes) > 1:
            raise ConfigError(f"pipeline.partition 'parameters': the blocks hold {sorted(sizes)} parameters; minizero "
                              "cuts by block count, which balances parameters only for equal blocks: use 'uniform'")
        self.config = cfg                 # the checked config
        self.world = comm                 # every rank of the job
        self.mesh = Mesh(comm, pp=pipe["stages"])   # dp x pp; mesh.dp is what DeepSpeed calls the dp world
        self.comm = self.mesh.dp          # the data-parallel ranks (as Engine.comm)
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
        """Global L2 norm over all stages (and ZeRO-1 shards), tied weights once; torch's coefficient."""
        tied = {id(q) for q in self.pipeline.tied} if not self.mesh.is_first_stage else set()
        sq = torch.zeros(1, device=self.device)
        if self.stage == 0:
            grads = [p.grad for p in self.optimizer.param_groups[0]["params"] if p.grad is not None]
            for p in self.optimizer.param_groups[0]["params"]:
                if p.grad is not None and id(p) not in tied:  # the last stage's copy of a tied weight: once
                    sq += p.grad.pow(2).sum()
            self.mesh.pp.all_reduce(sq, op="sum")  # replicated over dp: add the stages only
        else:
            opt = self.optimizer
            shard = opt.reduce_gradients()
            grads = [shard]
            sq += shard.pow(2).sum()
            for piece in opt.layout.pieces(self.comm.rank):
                if id(opt.params[piece.index]) in tied:
                    sq -= shard[piece.shard_lo:piece.shard_lo + piece.hi - piece.lo].pow(2).sum()
            self.world.all_reduce(sq, op="sum")  # every rank holds a different piece: dp shards x stages
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
