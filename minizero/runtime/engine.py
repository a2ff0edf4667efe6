"""minizero.runtime.engine: DeepSpeed's training loop, composed from minizero's building blocks.

    engine = minizero.initialize(model, "ds_config.json")      # or a dict; DeepSpeed's keys (config.py)
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
  zero_quantized_weights / zero_hpz_partition_size / zero_quantized_gradients (stage 3 only, else an
    error) -> zero.ZeroPP (qwZ / hpZ / qgZ) instead of FSDP, its nodes zero_hpz_partition_size ranks each
    (or the `mesh=` given to initialize).
  tensor_parallel.autotp_size t > 1: a dp x tp Mesh; the model split over mesh.tp (tensor.TensorParallelGPT,
    with tensor_parallel.sequence_parallel), DDP/ZeRO over mesh.dp, the batch split over the dp ranks
    only (engine.dp_rank, engine.dp_size), clipping on the full model's norm (runtime/tensor_parallel.py).
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
Not available yet, an error before any collective: checkpoints with
tensor parallelism.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from minizero.runtime import checkpoint
from minizero import comm as comm_mod
from minizero import memory
from minizero.runtime.config import ConfigError, load_config
from minizero.precision import LossScaler, MixedPrecisionOptimizer
from minizero.runtime.schedulers import build_scheduler
from minizero.runtime.tensor_parallel import check_model, norm_weights, split_over_tp
from minizero.zero.flat_shard_optimizer import covering_param_groups
from minizero.zero.infinity import release_pages


def _world_size(comm) -> int:
    """The world size WITHOUT creating a communicator, so a bad config fails before any collective."""
    if comm is not None:
        return comm.size
    if comm_mod.is_initialized():
        return comm_mod.get().size
    return comm_mod.launched_world_size()


def check_available(cfg: dict):
    """What the engine cannot do (yet) with a valid config: an error saying what to do, raised
    before any collective. Builds the optimizer and the scheduler on a dummy tensor to check
    their params the same way."""
    if cfg["optimizer"] is None:
        raise ConfigError("the engine needs an 'optimizer' section, "
                          "e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-3}}")
    cls, kw = optimizer_spec(cfg["optimizer"])
    try:
        build_scheduler(cls([torch.zeros(1, requires_grad=True)], **kw), cfg["scheduler"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optimizer/scheduler params: {e}") from None
    if cfg["fp16"]["enabled"]:  # the loss scaler's own checks, on a throwaway one: before the model is cast
        try:
            LossScaler(**{k: v for k, v in cfg["fp16"].items() if k != "enabled"})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"fp16: {e}") from None


def optimizer_spec(section: dict):
    """DeepSpeed's optimizer section -> (torch optimizer class, kwargs), by DeepSpeed's rules."""
    params = dict(section.get("params", {}))
    if "max_grad_norm" in params:
        raise ConfigError("'max_grad_norm' is not an optimizer parameter (as in DeepSpeed): use gradient_clipping")
    if section["type"] == "SGD":
        return torch.optim.SGD, params
    adam_w_mode = params.pop("adam_w_mode", True)  # DeepSpeed: "Adam" is AdamW unless told otherwise
    params.pop("torch_adam", None)                 # DeepSpeed's switch to torch's Adam: always torch here
    params.setdefault("weight_decay", 0.0)          # FusedAdam's default (torch's AdamW says 0.01)
    return (torch.optim.AdamW if section["type"] == "AdamW" or adam_w_mode else torch.optim.Adam), params


def _checkpoint(model) -> list[str]:
    from minizero.activation_checkpointing import checkpoint_blocks
    try:
        return checkpoint_blocks(model)
    except ValueError as e:
        raise ConfigError(f"activation_checkpointing: {e}") from None


def check_model_parameters(model: torch.nn.Module, model_parameters):
    """DeepSpeed's `model_parameters`: param groups (or tensors) of the model's parameters, e.g. nanoGPT's
    decay / no-decay pair, each group's values over the config's optimizer params. Every trainable
    parameter must be in exactly one group. None: one group of model.parameters()."""
    return None if model_parameters is None else covering_param_groups(model, model_parameters, "model_parameters")


def initialize(model: torch.nn.Module, config, comm=None, model_parameters=None, mesh=None) -> "Engine":
    """minizero's deepspeed.initialize: a model and a DeepSpeed config (dict or JSON path) -> Engine.
    model_parameters: param groups, as DeepSpeed takes them (check_model_parameters).
    (DeepSpeed returns a 4-tuple; here engine.optimizer and engine.lr_scheduler hold the others.)
    mesh: a comm.Mesh whose nodes ZeRO++ uses (its world is the communicator); without one, ZeRO++'s
    simulated nodes are zero_hpz_partition_size consecutive ranks (all ranks one node when that is 1)."""
    if mesh is not None:
        comm = mesh.world
    cfg = load_config(config, _world_size(comm))
    check_available(cfg)
    hpz = cfg["zero_optimization"]["zero_hpz_partition_size"]
    if mesh is not None and hpz > 1 and hpz != mesh.node_size:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size={hpz} but the mesh has nodes of "
                          f"{mesh.node_size} ranks: hpZ's groups are the mesh's nodes; make them agree")
    if cfg["pipeline"]["stages"] > 1:
        from minizero.runtime.pipeline_engine import PipelineEngine, check_pipeline
        check_pipeline(cfg)
        return PipelineEngine(model, cfg, comm or comm_mod.get())
    check_model(model, cfg)
    groups = check_model_parameters(model, model_parameters)
    if groups and len(groups) > 1 and cfg["zero_optimization"]["offload_optimizer"]["device"] != "none":
        raise ConfigError(f"model_parameters has {len(groups)} param groups, but offload_optimizer steps each shard on "
                          "the host as ONE group: pass one group (its lr/weight_decay apply) or remove offload_optimizer")
    if groups and cfg["tensor_parallel"]["autotp_size"] > 1:
        raise ConfigError("model_parameters with tensor_parallel.autotp_size > 1 is not implemented: the split replaces "
                          "the model's parameters by their slices, so groups of the originals would train nothing; "
                          "leave model_parameters out (one group) or set autotp_size 1")
    return Engine(model, cfg, comm or comm_mod.get(), groups, mesh)


class Engine:
    def __init__(self, model: torch.nn.Module, cfg: dict, comm, groups=None, mesh=None):
        self.config = cfg     # the checked config, every default filled in (runtime/config.py)
        self.comm = comm      # every rank: votes (fp16 overflow), norms, checkpoints
        self.module = model   # the plain model (DeepSpeed's engine.module); with TP its parallel version
        self.node_mesh = mesh  # ZeRO++'s nodes (None: built from zero_hpz_partition_size when needed)
        # activation_checkpointing section present: every block recomputes its inside in backward (before any
        # collective; a TP split converts the blocks in place, so they stay checkpointed)
        self.checkpointed_blocks = _checkpoint(model) if cfg["activation_checkpointing"] is not None else []
        zero = cfg["zero_optimization"]
        self.stage = zero["stage"]
        self.dtype = torch.float16 if cfg["fp16"]["enabled"] else torch.bfloat16 if cfg["bf16"]["enabled"] \
            else torch.float32
        self.half = self.dtype != torch.float32
        # what a checkpoint must map back to the plain model (FSDP removes the parameters from it)
        self.param_shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
        first = {}
        self.aliases = {}  # a tied weight's other names -> the name named_parameters() gives it
        for n, p in model.named_parameters(remove_duplicate=False):
            if first.setdefault(id(p), n) != n:
                self.aliases[n] = first[id(p)]
        self.state_dict_keys = list(model.state_dict().keys())
        self.mesh, model = split_over_tp(model, cfg, comm)  # a dp x tp Mesh, or None without TP
        self.module = model
        self.dp_comm = self.mesh.dp if self.mesh else comm  # the ranks that split the batch and reduce gradients
        self.dp_rank, self.dp_size = self.dp_comm.rank, self.dp_comm.size  # which micro-batch is this rank's
        self.tp_split_names = {n for n, p in model.named_parameters(remove_duplicate=False)
                               if hasattr(p, "tensor_parallel_dim")}  # for the norm under ZeRO-3
        self.device = comm.device  # one rank per GPU (comm picks it); move your batches there, as in DeepSpeed
        from minizero.zero.init import built_with_init
        self.zero_init = built_with_init(model)  # built under zero.Init: FSDP materializes it unit by unit
        if self.zero_init is not None:
            if self.stage != 3:
                raise ConfigError(f"a model built under zero.Init needs ZeRO stage 3, got stage {self.stage}")
            self.zero_init.dtype = self.dtype if self.half else None  # rounded as model.to(dtype) would
        else:
            model.to(self.device, self.dtype if self.half else None)
        cls, kw = optimizer_spec(cfg["optimizer"])
        bucket_numel = int(zero["reduce_bucket_size"])  # elements, as in DeepSpeed: no unit to convert
        if self.stage == 0:
            from minizero.dp.ddp import DDP
            self.wrapped = DDP(model, self.dp_comm, bucket_numel=bucket_numel, overlap=zero["overlap_comm"])
            params = groups or self.wrapped.params
            self.optimizer = MixedPrecisionOptimizer(params, cls, None, 0.0, self.dp_comm, **kw) if self.half \
                else cls(params, **kw)
        elif self.stage == 1:
            from minizero.zero.sharded_optimizer import ShardedOptimizer
            self.dp_comm.broadcast_tensors([p for p in model.parameters() if not p.requires_grad] + list(model.buffers()))
            self.wrapped = model
            self.optimizer = ShardedOptimizer(groups or model.parameters(), cls, self.dp_comm, **kw)
        elif self.stage == 2:
            from minizero.zero.shard_grad_op import ShardGradOp
            self.wrapped = ShardGradOp(model, cls, self.dp_comm, bucket_numel=bucket_numel, overlap=zero["overlap_comm"],
                                       params=groups, **kw)
            self.optimizer = self.wrapped.optim
        else:
            from minizero.zero.fsdp import FSDP
            from minizero.zero.fsdp_optimizer import FSDPOptimizer
            if self.zero_init is None:  # FSDP shards each rank's OWN copy; zero.Init replays the same seed everywhere
                self.dp_comm.broadcast_tensors([*model.parameters(), *model.buffers()])
            prefetch = zero["overlap_comm"] and zero["stage3_prefetch_bucket_size"] > 0
            fsdp_kw = dict(compute_dtype=self.dtype if self.half else None, prefetch=prefetch,
                           persistence_threshold=int(zero["stage3_param_persistence_threshold"]))
            hpz = zero["zero_hpz_partition_size"]
            if zero["zero_quantized_weights"] or zero["zero_quantized_gradients"] or hpz > 1:
                from minizero.comm import Mesh
                from minizero.zero.zeropp import ZeroPP
                self.node_mesh = self.node_mesh or Mesh(comm, node_size=hpz if hpz > 1 else None)
                self.wrapped = ZeroPP(model, self.node_mesh, quantized_weights=zero["zero_quantized_weights"],
                                      hpz=hpz > 1, quantized_gradients=zero["zero_quantized_gradients"], **fsdp_kw)
            else:
                self.wrapped = FSDP(model, self.dp_comm, **fsdp_kw)
            if self.zero_init is not None:  # buffers and frozen parameters (the local parts stay fp32 shard views)
                trained = {id(p) for p in self.wrapped.parameters() if p.requires_grad}
                for t in [*model.buffers(), *(p for p in model.parameters() if id(p) not in trained)]:
                    t.data = t.data.to(self.device, self.dtype if self.half and t.is_floating_point() else None)
            self.optimizer = FSDPOptimizer(self.wrapped, cls, groups, **kw)  # groups of originals map
        # checkpoints name each trained tensor (FSDP's local parts carry the original names)
        self.param_names = {id(p): n for n, p in (self.wrapped if self.stage == 3 else model).named_parameters()}
        self.offload = self._offload(cls, kw) if zero["offload_optimizer"]["device"] != "none" else None
        f16 = {k: v for k, v in cfg["fp16"].items() if k != "enabled"}
        self.loss_scaler = LossScaler(**f16) if cfg["fp16"]["enabled"] else None
        self.lr_scheduler = build_scheduler(self.optimizer, cfg["scheduler"])
        self.global_steps = 0     # optimizer steps, skipped ones included (DeepSpeed's count)
        self.global_samples = 0   # samples seen, over all ranks
        self.micro_steps = 0      # backward passes
        self.skipped_steps = 0    # fp16 overflows
        self.overflow = False     # the last step was skipped
        self.grad_norm = None     # the last step's global gradient norm
        self.outputs = None       # the last forward's full output
        self._shard_grad = None
        self.timings = {"forward": 0.0, "backward": 0.0, "step": 0.0}  # seconds spent in the last optimizer step
        self._fwd = self._bwd = 0.0

    def _broadcast(self, tensors):
        """Rank 0's values on every data-parallel rank, packed (PipelineEngine calls it too: its comm is mesh.dp)."""
        getattr(self, "dp_comm", self.comm).broadcast_tensors(list(tensors))

    # ------------------------------------------------------------------ DeepSpeed's accessors
    def train_batch_size(self) -> int:
        return self.config["train_batch_size"]

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config["train_micro_batch_size_per_gpu"]

    def gradient_accumulation_steps(self) -> int:
        return self.config["gradient_accumulation_steps"]

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the NEXT step() call steps the optimizer."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def lr(self) -> float:
        return self.get_lr()[0]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    def get_global_grad_norm(self):
        """The norm before clipping, of the last applied step (None when clipping is off)."""
        return self.grad_norm

    def was_step_applied(self) -> bool:
        return not self.overflow

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
        if self.stage == 1 and torch.is_grad_enabled():  # no wrapper here: rank 0's buffers, as DDP does
            self.dp_comm.broadcast_tensors(list(self.module.buffers()))
        self.outputs = out = self.wrapped(*args, **kwargs)
        self._fwd += time.perf_counter() - t0
        loss = out.get("loss") if isinstance(out, dict) else out[-1] if isinstance(out, (tuple, list)) and out \
            else getattr(out, "loss", None)
        return loss if torch.is_tensor(loss) and loss.dim() == 0 else out

    forward = __call__

    def backward(self, loss: torch.Tensor):
        """loss / gradient_accumulation_steps (x the loss scale under fp16), then backward. At stage 0
        a backward before the boundary only accumulates locally (DDP.no_sync)."""
        t0 = time.perf_counter()
        if self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        quiet = self.stage == 0 and not self.is_gradient_accumulation_boundary()
        with self.wrapped.no_sync() if quiet else nullcontext():
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
        if self.offload is not None:
            self.offload.finish()  # DPU: the step in flight lands now (its parameters go to the device)
        sharded, replicated = self._reduced_grads()
        self.overflow = False
        if self.loss_scaler is not None:
            self.overflow = self.loss_scaler.unscale_and_check(sharded + replicated, self.comm)
            self.loss_scaler.update(self.overflow)  # raises MinLossScaleError at the floor
        if self.overflow:
            self.skipped_steps += 1
        else:
            if self.config["gradient_clipping"] > 0:
                self.grad_norm = self._clip(sharded, replicated, self.config["gradient_clipping"])
            self._apply()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.zero_grad()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.timings = {"forward": self._fwd, "backward": self._bwd, "step": time.perf_counter() - t0}
        self._fwd = self._bwd = 0.0

    def _reduced_grads(self):
        """The gradients averaged over the global batch, in fp32 (x the loss scale): (sharded: this
        rank's piece only, replicated: the same on every rank). Unscaling and clipping work in place."""
        opt = self.optimizer
        if self.offload is not None:
            return self._host_grads()
        if self.stage == 0:
            self.wrapped.finish_gradient_synchronization()
            if not self.half:
                return [], [p.grad for p in self.wrapped.params if p.grad is not None]
            for p, m in zip(opt.params, opt.masters):
                m.grad = None if p.grad is None else p.grad.float()
            return [], [m.grad for m in opt.masters if m.grad is not None]
        if self.stage in (1, 2):
            g = opt.reduce_gradients() if self.stage == 1 else self.wrapped.grad_shard
            self._shard_grad = g.float()  # the same tensor in fp32; a copy of a 16-bit shard
            return [self._shard_grad], []
        parts = list(zip(opt.parts, opt.grads()))  # FSDP's flat fp32 gradients, unit by unit
        return ([g for (_, part), g in parts if part == "shard" and g is not None],
                [g for (_, part), g in parts if part == "whole" and g is not None])

    @torch.no_grad()
    def _clip(self, sharded, replicated, max_norm):
        w_sharded, w_replicated = norm_weights(self, sharded, replicated)  # 1 or 1/t per element with TP
        sq = torch.zeros(1, device=self.comm.device)
        for g, w in zip(sharded, w_sharded):
            sq += g.pow(2).sum() if w is None else (w * g.pow(2)).sum()
        if self.stage > 0:
            self.comm.all_reduce(sq, op="sum")  # every rank holds a different piece: add them up
        whole = sq if self.mesh is None else torch.zeros(1, device=self.comm.device)
        for g, w in zip(replicated, w_replicated):
            whole += g.pow(2).sum() if w is None else (w * g.pow(2)).sum()  # the same on every dp rank: once
        if self.mesh is not None:
            self.mesh.tp.all_reduce(whole, op="sum")  # the tp group's slices (and 1/t of each whole copy)
            sq += whole
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s formula
        for g in sharded + replicated:
            g.mul_(coef)
        return norm.item()

    @torch.no_grad()
    def _apply(self):
        opt = self.optimizer
        if self.offload is not None:
            self.offload.step()  # CPU step (in a thread under DPU), parameters up, ZeRO-1/2 all-gather
        elif self.stage == 0 and self.half:
            opt.step_masters()
            for p, m in zip(opt.params, opt.masters):
                p.copy_(m)  # round the fp32 masters into the 16-bit model
        elif self.stage in (1, 2):
            opt.step_shard(self._shard_grad)  # step the fp32 shard, all-gather the parameters
        else:
            opt.step()

    def zero_grad(self):
        if self.offload is not None:
            self.offload.zero_grad()
        if self.stage == 2:
            self.wrapped.zero_grad()
        elif self.stage == 1:
            self.optimizer.zero_grad()
        elif self.offload is None:
            self.optimizer.zero_grad(set_to_none=True)
            for m in getattr(self.optimizer, "masters", ()):
                m.grad = None
        self._shard_grad = None

    # ------------------------------------------------------------------ measurements
    def memory(self) -> memory.Ledger:
        """The bytes this rank holds, by category (memory.measure walks the real tensors)."""
        objects = {0: (self.wrapped, self.optimizer), 1: (self.module, self.optimizer), 2: (self.wrapped,),
                   3: (self.wrapped, self.optimizer)}[self.stage]
        if self.offload is not None:  # first: its explicit locations (host, disk) win for shared storages
            objects = (self.offload, *self._offloaded_params(), *(o for o in objects if o is not self.offload))
        return memory.measure(*objects)

    def offload_traffic(self) -> dict:
        """Bytes moved device -> host, host -> device, and to/from disk since the last reset."""
        return self.offload.traffic.as_dict() if self.offload is not None else {}

    def comm_stats(self) -> dict:
        """Bytes this rank sent per collective since comm.stats.reset() (comm.CommStats.as_dict)."""
        return self.comm.stats.as_dict()

    # ------------------------------------------------------------------ checkpoints
    def _no_tp(self, what):
        if self.mesh is not None:  # the same on every rank: raised before any collective
            raise NotImplementedError(f"{what} with tensor parallelism is not implemented: the checkpoint format "
                                      "shards over the data-parallel ranks only (each tp rank holds other slices)")

    def save_checkpoint(self, save_dir, tag=None, client_state=None):
        """Every rank writes its shard; see minizero.runtime.checkpoint. A collective. client_state: plain data
        (numbers, strings, lists, dicts, tensors), handed back by load_checkpoint."""
        self._no_tp("save_checkpoint")
        if self.offload is not None:
            self.offload.finish()  # DPU: the checkpoint holds the update in flight
        return checkpoint.save(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir, tag=None):
        """-> (path, client_state), as DeepSpeed. Validates everything before changing anything."""
        self._no_tp("load_checkpoint")
        out = checkpoint.load(self, load_dir, tag)
        if self.offload is not None:
            if self.stage == 3:
                self.offload.sync_masters_from_device()  # the checkpoint wrote the device shards
            self.offload.steps = self.global_steps - self.skipped_steps  # DPU's warm-up resumes where it was
        return out

    def full_state_dict(self) -> dict:
        """The plain model's state dict in fp32, on every rank (a collective: gathers the shards)."""
        self._no_tp("full_state_dict")
        if self.offload is not None:
            self.offload.finish()
        return checkpoint.full_state_dict(self)

    # ------------------------------------------------------------------ offload
    def _offload(self, cls, kw):
        """ZeRO-Offload (cpu) or ZeRO-Infinity (nvme) for this stage; replaces the device optimizer."""
        from minizero.zero.offload import HostOptimizer, Traffic
        zero, aio = self.config["zero_optimization"], self.config["aio"]
        section = zero["offload_optimizer"]
        traffic = Traffic()
        if self.stage in (1, 2):
            opt = self.optimizer  # ShardedOptimizer: its fp32 master and torch optimizer move to the host
            host = HostOptimizer([opt.shard], cls, traffic, section["pin_memory"], section["dpu_warmup_steps"],
                                 after_params=lambda: self._all_gather(opt), **kw)
            opt.master, opt.optim = host.masters[0], host  # checkpoints find them there
            # every view of the device fp32 master goes too, or its 4 bytes per shard element stay on the
            # device (measured on an H100: 8 bytes per parameter held after initialize instead of 4)
            opt.masters = [host.masters[0]]
            for run in opt.runs:
                run.tensor = host.masters[0].detach()[run.lo:run.hi]
            host.param_groups = opt.param_groups  # the scheduler edits the user's one group; each step copies it
            return host
        units = self.wrapped.units
        params = [p for u in units for p in (u.shard, u.whole) if p is not None]
        if section["device"] == "nvme":
            from minizero.zero.infinity import DiskOptimizer
            host = DiskOptimizer(params, cls, section["nvme_path"], int(zero["sub_group_size"]), self.comm.rank,
                                 traffic, prefetch=aio["overlap_events"], pin_memory=section["pin_memory"],
                                 io_threads=aio["thread_count"], param_nvme_path=zero["offload_param"]["nvme_path"]
                                 if zero["offload_param"]["device"] == "nvme" else None, **kw)
            if host.param_dir is not None:  # the shards' storage is now in files: the local parts follow it
                self.wrapped.point_local_parts_at_shards()
        else:
            host = HostOptimizer(params, cls, traffic, section["pin_memory"], section["dpu_warmup_steps"], **kw)
        host.param_groups = self.optimizer.param_groups  # FSDPOptimizer's one group, as the user gave it
        index = {(id(u), part): i for i, (u, part) in enumerate((u, part) for u in units for part in ("shard", "whole")
                                                                 if getattr(u, part) is not None)}
        # each unit's gradient goes down as soon as backward reduced it: the device keeps none between units
        self.wrapped.grad_sink = lambda unit, part, grad: host.accumulate(index[(id(unit), part)], grad)
        if zero["offload_param"]["device"] != "none":
            if self.device.type != "cpu":  # the shards would have to move to CPU memory and autograd with them
                raise ConfigError("offload_param is implemented for CPU runs only (where the host shard and its device "
                                  "copy are both host memory); on CUDA remove offload_param, keep offload_optimizer")
            self.wrapped.fetch_shard = self._fetch_shard
        self.optimizer = host
        return host

    def _fetch_shard(self, unit, shard):
        """offload_param: the shard lives on the host (cpu) or in a mapped file (nvme); this device copy
        exists for its all-gather."""
        nbytes = shard.numel() * shard.element_size()
        self.offload.traffic.to_device += nbytes
        if getattr(self.offload, "param_dir", None) is None:
            return shard.to(self.device, copy=True)
        self.offload.traffic.disk_read += nbytes  # read out of the shard's file
        copy = shard.to(self.device, copy=True)
        release_pages(shard)  # the file's pages leave this process again until the next gather
        return copy

    def _offloaded_params(self):
        """offload_param: the parameter shards are reported where they live, on the host."""
        if self.stage != 3 or self.config["zero_optimization"]["offload_param"]["device"] != "cpu":
            return ()  # nvme: the DiskOptimizer reports the parameter files
        return (_HostShards([p for u in self.wrapped.units for p in (u.shard, u.whole) if p is not None]),)

    @torch.no_grad()
    def _all_gather(self, opt):
        send = opt.shard.clone()  # MPI may not send from inside the buffer it receives into
        self.dp_comm.all_gather(opt.flat, send)  # the ranks ZeRO-1/2 shard over

    def _host_grads(self):
        """Offload: this rank's reduced gradients, moved to the host (fp32). ZeRO-3's are there already."""
        if self.stage in (1, 2):
            g = self.optimizer.reduce_gradients() if self.stage == 1 else self.wrapped.grad_shard
            self.offload.grads_to_host([g])
            return self.offload.grads, []
        whole = {id(u.whole) for u in self.wrapped.units if u.whole is not None}
        pairs = list(zip(self.offload.device_params, self.offload.grads))
        return [g for p, g in pairs if id(p) not in whole], [g for p, g in pairs if id(p) in whole]


class _HostShards:
    """For the ledger: ZeRO-3's parameter shards under offload_param live on the host."""

    def __init__(self, params):
        self.params = params

    def memory_tensors(self):
        for p in self.params:
            yield "parameters", p, "host"
