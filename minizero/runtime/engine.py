"""minizero.runtime.engine: DeepSpeed's training loop, composed from minizero's building blocks.

    engine, optimizer, _, _ = minizero.initialize(model=model, config="ds_config.json")  # DeepSpeed's call
                                                                   # (runtime/initialize.py); keys: config.py
    for step in range(steps):
        for micro in range(engine.gradient_accumulation_steps()):
            loss = engine(x, y)        # this rank's micro-batch; models return (logits, loss): the loss
            engine.backward(loss)      # loss / accumulation steps (x the fp16 loss scale), backward
            engine.step()              # the optimizer steps only at the accumulation boundary

Your own loss: an output without a loss (`engine(x)`: TinyGPT returns (logits, None)) comes back as
it is: `logits, _ = engine(x); engine.backward(my_loss(logits, y))`. `engine.outputs` keeps it too.

The config, with DeepSpeed's meaning (checked against deepspeed/runtime/engine.py):
  zero_optimization.stage 0 -> dp.DDP (+ precision.MixedPrecisionOptimizer in 16 bits), 1 ->
    zero.ShardedOptimizer, 2 -> zero.ShardGradOp, 3 -> zero.FSDP + the optimizer on its fp32 shards.
  reduce_bucket_size is in ELEMENTS -> DDP / ZeRO-2 buckets of that many gradients. ZeRO-1 reduce-
    scatters, and ZeRO-1/2 all-gather, the whole flat buffer in one call (allgather_bucket_size: one
    bucket; contiguous_gradients: always). overlap_comm -> DDP "overlap" mode, ShardGradOp(overlap=), and at
    stage 3 (with stage3_prefetch_bucket_size > 0) FSDP's prefetch. stage3_param_persistence_threshold
    -> FSDP's; FSDP never holds more than one unit plus one prefetched (stage3_max_live_parameters).
    Keys with no effect here warn when set to a non-default value (config.NO_EFFECT says why).
  gradient_accumulation_steps: backward divides the loss by it (DeepSpeed's scale_wrt_gas); stage 0
    accumulates locally (DDP.no_sync) and all-reduces once, stage 1 reduce-scatters once, stages 2
    and 3 reduce every micro-batch (as DeepSpeed's do).
  gradient_clipping: the global L2 norm (sharded gradients' squares summed across ranks, replicated
    ones counted once), of the unscaled gradients, with torch's coefficient.
  fp16: the model in fp16, fp32 masters, precision.LossScaler with the section's keys. An overflow on
    any rank skips the step: no optimizer or scheduler step, but global_steps advances (DeepSpeed's
    _take_model_step); at min_loss_scale it raises MinLossScaleError. bf16: fp32 masters, no scaling;
    micro-batch gradients add up in bf16 (DeepSpeed's BF16_Optimizer adds them in fp32: with
    accumulation, minizero's bf16 rounds more). Floating inputs are cast to the model's dtype.
  optimizer: "Adam" is AdamW unless params.adam_w_mode is false, weight decay 0 by default (DeepSpeed).
  pipeline.stages > 1: runtime/pipeline_engine.py's PipelineEngine (engine.train_batch(data_iter)).

The chain (each step a function of resolve.Plan, runtime/resolve.py; docs/design.md draws it):
  tensor parallel (the model split over mesh.tp) -> activation checkpointing (blocks recompute) ->
  [pipeline stage] -> data-parallel strategy (runtime/strategies.py: DDP, ZeRO-1/2/3, ZeRO++; offload a
  part of it) -> precision (the model cast, fp32 masters, the loss scaler). Counters, scheduler, accessors
  and the clip are runtime/trainer.py's TrainerCore, shared with the pipeline engine by composition.
  zero_quantized_weights / zero_hpz_partition_size / zero_quantized_gradients (stage 3 only, else an
    error) -> zero.ZeroPP (qwZ / hpZ / qgZ) instead of FSDP, its nodes zero_hpz_partition_size ranks each
    (or the `mesh=` given to initialize).
  tensor_parallel.autotp_size t > 1: a dp x tp Mesh; the model split over mesh.tp (tensor.TensorParallelGPT,
    with tensor_parallel.sequence_parallel), DDP/ZeRO over mesh.dp, the batch split over the dp ranks
    only (engine.dp_rank, engine.dp_size), clipping on the full model's norm (runtime/trainer.py).
  sequence_parallel_size cp > 1 (DeepSpeed's key, DeepSpeed-Ulysses): a dp x cp Mesh; the model's hook
    set_context_parallel(mesh.cp) (TinyGPT's) makes its forward take whole sequences, keep this rank's
    contiguous s/cp tokens (positions offset) and run every attention as Ulysses (context/ulysses.py), or with
    context_parallel.attention "ring" (a minizero key) keep chunks r and 2cp-1-r and run ring attention; the
    batch is split over the dp ranks only (engine.dp_size = world / cp), the gradients are reduced (and ZeRO
    shards) over the dp x cp ranks (engine.dp_comm; runtime/expert_strategy.py says why). Not with pipeline,
    TP or ZeRO++ (config errors).
  MoE layers (minizero.moe.MoE, DeepSpeed's deepspeed.moe.layer.MoE with ep_size) in the model: a Mesh with
    ep = ep_size; each layer keeps its E/ep experts and exchanges over mesh.ep; at stage 0 dense gradients are
    all-reduced over mesh.dp, expert ones over mesh.expert_dp, both / dp; at stage 1 each kind has its own
    ZeRO-1 optimizer over its group (runtime/expert_strategy.py); the clip counts every expert once. ZeRO-2/3,
    offload, param groups at stage 1, pipeline, TP, CP and checkpoints with ep_size > 1 are refused (config
    errors; NotImplementedError for a checkpoint).
  offload_optimizer.device cpu (stages 1-3; zero/offload.py, ZeRO-Offload): fp32 masters, gradients and
    the optimizer state of this rank's shard on the host, torch's fused CPU optimizer; each boundary moves
    the reduced gradient shard down (ZeRO-3: each unit's gradient as backward produces it), unscales, votes
    and clips there, steps, and copies the parameters up (ZeRO-1/2 then all-gather). dpu_warmup_steps (a
    minizero key): the delayed parameter update after that many plain steps; an fp16 overflow drops that
    step's gradients and the update in flight still lands. device nvme (stage 3; zero/infinity.py): masters
    and state in files under nvme_path in sub_group_size pieces, prefetched (aio.overlap_events) by
    aio.thread_count threads. offload_param nvme (with offload_optimizer nvme): the parameter shards are mapped
    files under its nvme_path. offload_param cpu (stage 3): the parameter shards are host tensors, copied to
    the device before each all-gather (counted). engine.offload_traffic() gives the bytes moved.
  A model built under `with minizero.zero.Init(): model = ...` (stage 3) is materialized one unit at a time.
  activation_checkpointing (DeepSpeed's section; activation_checkpointing.py): present = every element of every
    nn.ModuleList (TinyGPT's blocks) runs under torch.utils.checkpoint (non-reentrant) and is recomputed in
    backward (with TP the recompute repeats the block's forward all-reduces). Its keys are accepted at
    DeepSpeed's defaults only; any other value is a ConfigError naming it. With pipeline.stages > 1 the
    stages' blocks are checkpointed the same way (runtime/pipeline_engine.py), every schedule included.
Checkpoints (runtime/checkpoint.py) save, resume and consolidate every mode, TP included.
"""
from __future__ import annotations

import time

import torch

from minizero import comm as comm_mod
from minizero import memory
from minizero.activation_checkpointing import checkpoint_blocks
from minizero.runtime import checkpoint
from minizero.runtime.chain import model_names, strategy_part
from minizero.runtime.expert_strategy import (
    ExpertDDPStrategy,
    ExpertZero1Strategy,
    dp_cp_group,
)
from minizero.runtime.pipeline_engine import PipelineEngine
from minizero.runtime.resolve import Plan, moe_layers, optimizer_spec, resolve  # noqa: F401  (optimizer_spec: tests)
from minizero.runtime.strategies import STRATEGIES, norm_weights
from minizero.runtime.trainer import TrainerCore, shares_core


def _world_size(comm) -> int:
    """The world size WITHOUT creating a communicator, so a bad config fails before any collective."""
    if comm is not None:
        return comm.size
    if comm_mod.is_initialized():
        return comm_mod.get().size
    return comm_mod.launched_world_size()


def _device(comm):
    """Where the ranks compute, read only when a rule needs it (offload_param)."""
    if comm is not None:
        return lambda: comm.device
    return lambda: comm_mod.get().device if comm_mod.is_initialized() else None


def build_engine(model: torch.nn.Module, config, comm=None, model_parameters=None, mesh=None,
                 client_optimizer=None, client_scheduler: bool = False):
    """A model and a DeepSpeed config (dict or JSON path) -> an Engine (PipelineEngine when pipeline.stages > 1).
    minizero.initialize (runtime/initialize.py) is DeepSpeed's signature around it.
    model_parameters: param groups, as DeepSpeed takes them (every trainable parameter in one group).
    client_optimizer: (class, defaults) of the optimizer a user passed, in place of the config's section.
    mesh: a comm.Mesh whose nodes ZeRO++ uses (its world is the communicator); without one, ZeRO++'s
    simulated nodes are zero_hpz_partition_size consecutive ranks (all ranks one node when that is 1).
    Every error is raised by resolve(), before any collective."""
    if mesh is not None:
        comm = mesh.world
    plan = resolve(config, _world_size(comm), model, model_parameters,
                   node_size=mesh.node_size if mesh is not None else None, device=_device(comm),
                   client_optimizer=client_optimizer, client_scheduler=client_scheduler)
    if plan.pp_size > 1:
        return PipelineEngine(model, plan, comm or comm_mod.get())
    return Engine(model, plan, comm or comm_mod.get(), mesh)


@shares_core
class Engine:
    def __init__(self, model: torch.nn.Module, plan: Plan, comm, mesh=None):
        cfg = plan.config
        self.plan = plan             # the resolved config (runtime/resolve.py): the chain below is a function of it
        self.world = comm            # every rank of the job: votes (fp16 overflow), norms, checkpoints
        self.comm = comm             # the same (DeepSpeed scripts and the tests read engine.comm)
        self.stage = plan.stage      # the ZeRO stage (strategies.STRATEGIES)
        self.dtype = plan.dtype      # fp32, fp16 or bf16
        self.half = plan.half
        self.device = comm.device    # one rank per GPU (comm picks it); move your batches there, as in DeepSpeed
        self.zero_init = plan.zero_init  # built under zero.Init: FSDP materializes it unit by unit
        # what a checkpoint maps back to the plain model (before TP splits it and ZeRO-3 removes its parameters)
        _, self.aliases, self.state_dict_keys, self.param_shapes = model_names(model)
        # 1. tensor, context, expert parallel: a dp x cp x tp Mesh (ep slices of dp), the model split over mesh.tp
        #    (in place), told its cp group (Ulysses) and its MoE layers their ep group; or none of it
        self.mesh = None
        if plan.tp_size > 1 or plan.cp_size > 1 or plan.ep_size > 1:
            from minizero.comm import Mesh
            self.mesh = Mesh(comm, tp=plan.tp_size, cp=plan.cp_size, ep=plan.ep_size)
        if plan.tp_size > 1:
            from minizero.tensor import TensorParallelGPT
            model = TensorParallelGPT(model, self.mesh.tp, cfg["tensor_parallel"]["sequence_parallel"])
        if plan.cp_size > 1:
            ring = cfg["context_parallel"]["attention"] == "ring"  # TinyGPT: s/cp tokens per rank, Ulysses or ring
            model.set_context_parallel(self.mesh.cp, attention="ring") if ring else model.set_context_parallel(self.mesh.cp)
        for layer in moe_layers(model) if plan.ep_size > 1 else []:
            layer.set_expert_parallel(self.mesh.ep)   # each rank keeps E/ep experts
        self.module = model          # the plain model (DeepSpeed's engine.module); with TP its parallel version
        self.name_of, _, _, _ = model_names(model)  # {id(parameter): name} of what this rank holds
        self.local_shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}  # TP: slices
        # how TP cut each parameter it splits: {name: [dim, chunks]} (tensor.layers.unshard puts it back)
        self.tp_split = {n: [p.tensor_parallel_dim, p.tensor_parallel_chunks]
                         for n, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "tensor_parallel_dim")}
        # 2. activation checkpointing (a TP split converted the blocks in place: they stay checkpointed)
        self.checkpointed_blocks = checkpoint_blocks(model) if cfg["activation_checkpointing"] is not None else []
        # the ranks that reduce the gradients (and shard ZeRO's states): dp, or dp x cp with sequence parallelism
        self.dp_comm = (dp_cp_group(self.mesh) if plan.cp_size > 1 else self.mesh.dp) if self.mesh else comm
        batch_comm = self.mesh.dp if self.mesh else comm  # the ranks that split the batch (a cp group shares rows)
        self.dp_rank, self.dp_size = batch_comm.rank, batch_comm.size  # which micro-batch is this rank's
        # 3. precision: the model in its training dtype (zero.Init's recorder rounds as model.to(dtype) would)
        if self.zero_init is not None:
            self.zero_init.dtype = self.dtype if self.half else None
        else:
            model.to(self.device, self.dtype if self.half else None)
        # 4. the data-parallel strategy, offload a part of it
        part = strategy_part(plan, model, self.dp_comm, mesh)
        if plan.ep_size > 1:  # MoE: experts reduced over mesh.expert_dp, dense parameters over mesh.dp
            self.strategy = (ExpertDDPStrategy if plan.stage == 0 else ExpertZero1Strategy)(model, self.mesh, part)
        else:
            self.strategy = STRATEGIES[plan.stage](model, self.dp_comm, part)
        self.node_mesh = self.strategy.part.zeropp["mesh"] if self.strategy.part.zeropp else None
        self.wrapped = self.strategy.wrapped
        self.offload = self.strategy.offload
        self.optimizer = self.strategy.optimizer  # a torch.optim.Optimizer (offloaded: it drives the tier)
        self.param_names = self.strategy.param_names(self.name_of)  # checkpoints name each trained tensor
        from minizero.precision import LossScaler
        f16 = {k: v for k, v in cfg["fp16"].items() if k != "enabled"}
        self.core = TrainerCore(cfg, self.optimizer, LossScaler(**f16) if cfg["fp16"]["enabled"] else None)
        self.timings = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.outputs = None       # the last forward's full output
        self._fwd = self._bwd = 0.0

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # ------------------------------------------------------------------ the loop
    def __call__(self, *args, **kwargs):
        """The model's forward on this rank's micro-batch. `engine(batch)` with one (x, y) tuple works
        too. Returns the loss when the model returns one ((out, loss), or .loss), else the outputs."""
        t0 = time.perf_counter()
        if len(args) == 1 and not kwargs and isinstance(args[0], (tuple, list)):
            args = tuple(args[0])
        if self.half:
            cast = lambda t: t.to(self.dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = [cast(a) for a in args], {k: cast(v) for k, v in kwargs.items()}
        self.strategy.forward_prelude()
        self.outputs = out = self.wrapped(*args, **kwargs)
        self._fwd += time.perf_counter() - t0
        loss = out.get("loss") if isinstance(out, dict) else out[-1] if isinstance(out, (tuple, list)) and out \
            else getattr(out, "loss", None)
        return loss if torch.is_tensor(loss) and loss.dim() == 0 else out

    forward = __call__

    def backward(self, loss: torch.Tensor):
        """loss / gradient_accumulation_steps (x the loss scale under fp16), then backward. DDP's backward
        before the boundary only accumulates locally (no_sync)."""
        t0 = time.perf_counter()
        if self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        with self.strategy.backward_context(self.is_gradient_accumulation_boundary()):
            loss.backward()
        self._bwd += time.perf_counter() - t0

    def step(self):
        """Count a micro-step; at the accumulation boundary: reduce, unscale and vote on overflow,
        clip, step the optimizer and the scheduler (unless skipped), zero the gradients."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        t0 = time.perf_counter()
        self.strategy.finish_offload()  # DPU: the step in flight lands now (its parameters go to the device)
        grads = self.strategy.reduced_grads()
        self.overflow = False
        if self.loss_scaler is not None:
            self.overflow = self.loss_scaler.unscale_and_check(grads.sharded + grads.replicated, self.comm)
            self.loss_scaler.update(self.overflow)  # raises MinLossScaleError at the floor
        if self.overflow:
            self.skipped_steps += 1
        else:
            if self.config["gradient_clipping"] > 0:
                self.clip(grads)
            self.strategy.apply()
        self.core.stepped()
        self.strategy.zero_grad()
        self.timings = {"forward": self._fwd, "backward": self._bwd, "step": time.perf_counter() - t0}
        self._fwd = self._bwd = 0.0

    def weight_of(self):
        """name -> its weight in the global norm (trainer.py), or None when every element counts once."""
        if self.mesh is None or self.mesh.tp_size == 1 and self.mesh.ep_size == 1:
            return None
        t, split = self.mesh.tp_size, self.tp_split
        expert = self.strategy.expert_names(self.param_names) if self.mesh.ep_size > 1 else set()
        copies = self.mesh.dp_size // self.mesh.ep_size
        # an expert's gradient is held whole by the dp/ep ranks of its expert_dp group: summed over the world once
        return lambda name: (1.0 if name in split else 1.0 / t) / (copies if name in expert else 1)

    def clip(self, grads) -> float:
        weight_of = self.weight_of()
        weights = norm_weights(grads, self.strategy.grad_names(self.param_names) if weight_of else None,
                               weight_of, self.device)
        return self.core.clip(grads, weights, self.world if self.strategy.shards else None,
                              [self.mesh.tp] if self.mesh is not None and self.mesh.tp_size > 1
                              and self.strategy.has_replicated else [])

    def zero_grad(self):
        self.strategy.zero_grad()

    # ------------------------------------------------------------------ measurements
    def memory(self) -> memory.Ledger:
        """The bytes this rank holds, by category (memory.measure walks the real tensors)."""
        return memory.measure(*self.strategy.memory_objects())

    def offload_traffic(self) -> dict:
        """Bytes moved device -> host, host -> device, and to/from disk since the last reset."""
        return self.strategy.offload_traffic()

    def comm_stats(self) -> dict:
        """Bytes this rank sent per collective since comm.stats.reset() (comm.CommStats.as_dict)."""
        return self.world.stats.as_dict()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None):
        """Every rank writes its shard; see minizero.runtime.checkpoint. A collective. client_state: plain data
        (numbers, strings, lists, dicts, tensors), handed back by load_checkpoint."""
        self._check_checkpointable()
        self.strategy.finish_offload()  # DPU: the checkpoint holds the update in flight
        return checkpoint.save(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir, tag=None):
        """-> (path, client_state), as DeepSpeed. Validates everything before changing anything."""
        self._check_checkpointable()
        out = checkpoint.load(self, load_dir, tag)
        if self.offload is not None:
            self.offload.steps = self.global_steps - self.skipped_steps  # DPU's warm-up resumes where it was
        return out

    def full_state_dict(self) -> dict:
        """The plain model's state dict in fp32, on every rank (a collective: gathers the shards)."""
        self._check_checkpointable()
        self.strategy.finish_offload()
        return checkpoint.full_state_dict(self)

    # ------------------------------------------------------------------ what a checkpoint asks
    def _check_checkpointable(self):
        """Every rank alike, before any collective: the checkpoint format has no key for an expert slice."""
        if self.plan.ep_size > 1:
            raise NotImplementedError(f"checkpoints of an engine with expert parallelism (ep_size={self.plan.ep_size}) "
                                      "are not implemented: each ep rank holds other experts under the same names, "
                                      "and the format keys only tensor-parallel slices (name@tp{k})")

    def checkpoint_layout(self) -> dict:
        """How this job's ranks split the model: tp slices are saved under name@tp{k} (runtime/checkpoint.py)."""
        return {"dp": self.dp_size, "pp": 1, "tp": self.mesh.tp_size if self.mesh is not None else 1,
                "tp_split": self.tp_split}

    def checkpoint_key(self, name: str) -> str | None:
        """The key this rank saves parameter `name` under (None: another rank saves it)."""
        return name if self.mesh is None or self.mesh.tp_size == 1 else f"{name}@tp{self.mesh.tp_rank}"

    def checkpoint_keys(self) -> list:
        """[(key, shape)] of every trained tensor this rank holds a part of."""
        return [(self.checkpoint_key(n), list(s)) for n, s in self.local_shapes.items()]

    def saves_extras(self) -> bool:
        """Whether this rank writes the frozen parameters and buffers (one rank of the replicas does)."""
        return self.dp_comm.rank == 0 and (self.mesh is None or self.mesh.tp_rank == 0)

    def extras(self) -> dict:
        """Frozen parameters and buffers (replicated, not trained, still the model's), by name."""
        frozen = [(n, p) for n, p in self.module.named_parameters() if not p.requires_grad]
        return dict(frozen + list(self.module.named_buffers()))
