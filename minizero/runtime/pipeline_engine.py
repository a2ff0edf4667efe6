"""minizero.runtime.pipeline_engine: the engine when `pipeline.stages` > 1 (DeepSpeed's
PipelineEngine).

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
train_batch_size = micro x m x dp is checked (config.py). `model` is a
minizero.pipeline.PipelineModel or has pipeline_parts() (TinyGPT); every rank keeps only its stage's
blocks.
  tensor_parallel.autotp_size t > 1 (3D: dp x pp x tp): the model is split over mesh.tp first
    (tensor.TensorParallelGPT, no sequence parallelism), then cut into stages; the t ranks of a
    stage run the same schedule on the same micro-batches, each sending its copy of the hidden state
    to its own counterpart in the next stage (the pipes are per tp rank: mesh.pp joins equal tp
    coordinates). Feed every tp rank of a data-parallel rank the same data (engine.dp_rank,
    engine.dp_size).
  zero_optimization.stage 0 -> DDP of the stage over mesh.dp (reduced once per step: the runtime
    runs every backward but the last inside no_sync); 1 -> ShardedOptimizer of the stage over
    mesh.dp. 2 and 3 are refused by the config, with the reason (config.PP_ZERO_MSG).
  gradient_clipping: the global norm over every stage (and ZeRO-1 shard); the tied embedding, which
    the first and last stage both hold after their all-reduce, is counted once; with TP a slice
    counts once and a tensor every tp rank holds whole counts 1/t per rank (runtime/trainer.py).
  The data-parallel strategy is the plain engine's (runtime/strategies.py) over the stage's
    parameters; counters, scheduler, accessors and the clip are BaseEngine's (runtime/trainer.py).
  Checkpoints: each stage's ranks save its parameters under their plain names (tp slices as
    name@tp{k}; the tied copy the last stage holds as name@pp{s}), so `consolidate` gives the plain
    model's state dict.
  activation_checkpointing: the stage's blocks run under torch.utils.checkpoint, as in the plain
    engine; ZB-H1's W pass recomputes a block a second time (after B), so the split keeps what it
    needs.
Not available with a pipeline (errors before any collective, runtime/resolve.py): fp16/bf16,
offload, sequence parallelism.
"""
from __future__ import annotations

import time

import torch

from minizero.comm import Mesh
from minizero.pipeline import PipelineModel, PipelineRuntime, PipelineStage
from minizero.runtime import chain
from minizero.runtime.resolve import EnginePlan, pipeline_parts
from minizero.runtime.trainer import BaseEngine


def _named(model, parts) -> torch.nn.Module:
    """What names the parameters: the user's module, or the PipelineModel's parts under
    embed/blocks/head."""
    if isinstance(model, torch.nn.Module):
        return model
    return torch.nn.ModuleDict({"embed": parts.embed, "blocks": torch.nn.ModuleList(parts.blocks),
                                "head": parts.head})


class PipelineEngine(BaseEngine):
    def __init__(self, model, plan: EnginePlan, comm):
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
            # no SP (resolve refuses it)
            model = chain.apply_tensor_parallel(model, plan, self.mesh)
            parts = PipelineModel(*model.pipeline_parts())
        else:
            parts = pipeline_parts(model)
            _, self.aliases, self.state_dict_keys, self.param_shapes = chain.model_names(
                _named(model, parts)
            )
        named = _named(model, parts)
        chain.apply_sparse_attention(named, plan)
        self.name_of, _, _, _ = chain.model_names(named)
        # how TP cut what it splits
        self.tp_split = {n: [p.tensor_parallel_dim, p.tensor_parallel_chunks]
                         for n, p in named.named_parameters(remove_duplicate=False)
                         if hasattr(p, "tensor_parallel_dim")}
        # activation_checkpointing: each block keeps only its input and recomputes its inside when
        # its backward needs it (B; a split schedule's W unpacks the same tensors, and torch
        # recomputes for it again)
        self.checkpointed_blocks = chain.apply_activation_checkpointing(
            torch.nn.ModuleList(parts.blocks), plan
        )
        self.dp_comm = self.mesh.dp       # the data-parallel ranks of this stage
        # which rows of the batch are this rank's
        self.dp_rank, self.dp_size = self.dp_comm.rank, self.dp_comm.size
        self._hold("pipeline", PipelineStage(parts, self.mesh, None if parts.hidden_shape is None
                                             else (plan.micro_batch_size, *parts.hidden_shape),
                                             # this rank's part of module
                                             num_chunks=plan.pipeline.chunks))
        self.pipeline.to(self.device)
        self.module = model  # the plain model, as the user built it (split over tp in 3D)
        self.tied_names = (
            {self.name_of[id(q)] for q in self.pipeline.tied}
            if not self.mesh.is_first_stage
            else set()
        )
        self.local_shapes = {
            self.name_of[id(p)]: tuple(p.shape)
            for p in self.pipeline.parameters()
            if p.requires_grad
        }
        buffers = {id(b): n for n, b in named.named_buffers()}
        self._extras = {
            **{self.name_of[id(p)]: p for p in self.pipeline.parameters() if not p.requires_grad},
            **{buffers[id(b)]: b for b in self.pipeline.buffers() if id(b) in buffers},
        }
        strategy = chain.select_strategy(plan, self.pipeline, self.dp_comm, runtime_syncs=True)
        self._attach(strategy, [self.mesh.pp] + ([self.mesh.tp] if self.mesh.tp_size > 1 else []))
        # DDP of the stage, whose no_sync the schedule drives
        # (None: ZeRO-1 wraps nothing, nor one dp rank)
        self._hold("wrapped", strategy.wrapped if strategy.wrapped is not self.pipeline else None)
        self.runtime = PipelineRuntime(self.pipeline, plan.pipeline.schedule,
                                       plan.gradient_accumulation_steps, data_parallel=self.wrapped)
        self.timings = {"pipeline": 0.0, "step": 0.0}
        self.outputs = None
        # DeepSpeed's PipelineEngine attributes its examples read
        self.num_stages = plan.pp_size                          # pipeline stages
        self.stage_id = self.mesh.pp_rank                       # this rank's stage
        self.micro_batches = plan.gradient_accumulation_steps   # micro-batches per train_batch
        self.micro_batch_size = plan.micro_batch_size
        # initialize(training_data=): a RepeatingLoader of this dp rank's share
        self.training_dataloader = None
        self.data_iterator = None        # what train_batch() reads when given no data_iter

    # ------------------------------------------------------------------
    # DeepSpeed's pipeline accessors
    def is_first_stage(self) -> bool:
        return self.mesh.is_first_stage

    def is_last_stage(self) -> bool:
        return self.mesh.is_last_stage

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def is_pipe_parallel(self) -> bool:
        return self.num_stages > 1

    def is_data_parallel(self) -> bool:
        return self.dp_size > 1

    def set_dataloader(self, loader):
        """train_batch() then reads `loader` (DeepSpeed: on the first and last stage, which use the
        data)."""
        self.training_dataloader = loader
        self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator):
        self.training_dataloader = None
        self.data_iterator = iterator

    def train(self, mode: bool = True):
        self.training = mode
        self.pipeline.train(mode)  # this rank's stage: the rest of the user's model is not here
        return self

    # ------------------------------------------------------------------ the loop
    def train_batch(self, data_iter=None):
        """One optimizer step over train_batch_size samples: m micro-batches (x, y) from data_iter
        (kept for the next calls, as DeepSpeed's; None: the one kept, or
        initialize(training_data=)'s) through the pipeline. Returns the batch's mean loss on every
        rank (DeepSpeed's train_batch)."""
        m = self.gradient_accumulation_steps()
        t0 = time.perf_counter()
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.train()  # as DeepSpeed's: eval_batch left the stage in eval mode
        x, y = self._batch(self.data_iterator, m)
        loss = self.runtime.step(x, y)
        t1 = time.perf_counter()
        self.apply_step(self.strategy.reduced_grads(), micro_steps=m)
        self.timings = {"pipeline": t1 - t0, "step": time.perf_counter() - t1}
        return self._batch_loss(loss)

    def _batch(self, data_iter, m):
        """m micro-batches (x, y) from data_iter, stacked: (None, None) on a rank given no data (a
        middle stage needs none)."""
        if data_iter is None:
            return None, None
        batch = [next(data_iter) for _ in range(m)]
        return (torch.cat([b[0] for b in batch]).to(self.device),
                torch.cat([b[1] for b in batch]).to(self.device))

    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg",
                   bcast_loss=True, num_micro_batches=None):
        """DeepSpeed's eval_batch: the mean loss of num_micro_batches (default: micro_batches)
        micro-batches from data_iter, forward only, the stage in eval mode (left so, as
        DeepSpeed's), averaged over the data-parallel ranks and given to every stage. Micro-batch k
        goes through every chunk before k + 1 starts."""
        for name, bad in (("return_logits", return_logits), ("compute_loss", not compute_loss),
                          ("reduce_output", reduce_output != "avg"),
                          ("bcast_loss", not bcast_loss)):
            if bad:
                raise NotImplementedError(f"eval_batch: {name} other than DeepSpeed's default is "
                                          "not implemented by minizero's pipeline engine; it "
                                          "returns the mean loss on every rank")
        m = self.micro_batches if num_micro_batches is None else num_micro_batches
        stage = self.pipeline
        self.eval()
        x, y = self._batch(data_iter, m)
        first = any(stage.is_first(c) for c in range(stage.num_chunks))
        last = any(stage.is_last(c) for c in range(stage.num_chunks))
        if (first and x is None) or (last and y is None):
            raise RuntimeError("eval_batch: this rank holds the first or last stage and needs "
                               "data_iter's batches")
        xs = x.chunk(m) if first else None
        ys = y.chunk(m) if last else None
        total, sends = torch.zeros((), device=self.device), []
        for k in range(m):
            for c in range(stage.num_chunks):
                if stage.is_first(c):
                    h = xs[k]
                else:
                    h, work = stage.recv_activation(k, c)
                    work.wait()
                out = stage.chunks[c](h)
                if stage.is_last(c):
                    total += stage.loss_fn(out, ys[k]).float()
                else:
                    sends.append((stage.send_activation(out.contiguous(), k, c), out))
        for work, _ in sends:
            work.wait()
        return self._batch_loss(total / m if last else None)

    def _batch_loss(self, loss):
        """The last stage's mean over its micro-batches, averaged over dp, sent to every stage."""
        out = (
            torch.zeros(1, device=self.device) if loss is None else loss.detach().reshape(1).clone()
        )
        if self.mesh.is_last_stage:
            self.dp_comm.all_reduce(out, op="avg")
        self.mesh.pp.broadcast(out, src=self.mesh.pp_size - 1)
        return out[0]

    def __call__(self, *args, **kwargs):
        raise RuntimeError("with pipeline.stages > 1 a step is engine.train_batch(data_iter), as "
                           "in DeepSpeed's PipelineEngine: one rank cannot run a micro-batch's "
                           "forward alone")

    forward = backward = step = __call__

    def weight_of(self):
        """name -> its weight in the global norm: 0 for the tied copy the first stage counts, 1/t
        for a tensor every tp rank holds whole, else 1 (runtime/trainer.py)."""
        t, split, tied = self.mesh.tp_size, self.tp_split, self.tied_names
        if t == 1 and not tied:
            return None  # every element counts once: no weights to build each step
        return lambda name: 0.0 if name in tied else 1.0 if t == 1 or name in split else 1.0 / t

    def extras(self) -> dict:
        return dict(self._extras)
