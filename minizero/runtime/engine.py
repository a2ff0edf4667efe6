"""minizero.runtime.engine: DeepSpeed's training loop, composed from minizero's building blocks.

    # DeepSpeed's call
    engine, optimizer, _, _ = minizero.initialize(model=model, config="ds_config.json")
    for step in range(steps):
        for micro in range(engine.gradient_accumulation_steps()):
            loss = engine(x, y)  # this rank's micro-batch; models return (logits, loss): the loss
            engine.backward(loss)      # loss / accumulation steps (x the fp16 loss scale), backward
            engine.step()              # the optimizer steps only at the accumulation boundary
    engine.save_checkpoint("ckpt")     # every rank its shard (runtime/checkpoint.py)

Your own loss: an output without a loss (`engine(x)`: TinyGPT returns (logits, None)) comes back as
it is: `logits, _ = engine(x); engine.backward(my_loss(logits, y))`. `engine.outputs` keeps it too.

What each config key does, with DeepSpeed's meaning: docs/engine.md. The engine is the chain of
runtime/chain.py over the resolved EnginePlan (runtime/resolve.py); what it shares with the pipeline
engine (the step's clip, measurements, checkpoints, counters) is runtime/trainer.py's BaseEngine.
"""
from __future__ import annotations

import time
import weakref
from contextlib import ExitStack

import torch

from minizero import comm as comm_mod
from minizero.runtime import chain
from minizero.runtime.pipeline_engine import PipelineEngine
# (optimizer_spec: tests)
from minizero.runtime.resolve import EnginePlan, optimizer_spec, resolve  # noqa: F401
from minizero.runtime.trainer import BaseEngine


def _world_size(comm) -> int:
    """The world size WITHOUT creating a communicator, so a bad config fails before any
    collective."""
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
    """A model and a DeepSpeed config (dict or JSON path) -> an Engine (PipelineEngine when
    pipeline.stages > 1). minizero.initialize (runtime/initialize.py) is DeepSpeed's signature
    around it. model_parameters: param groups, as DeepSpeed takes them (every trainable parameter in
    one group). client_optimizer: (class, defaults) of the optimizer a user passed, in place of the
    config's section. mesh: a comm.Mesh whose nodes ZeRO++ uses (its world is the communicator);
    without one, ZeRO++'s simulated nodes are zero_hpz_partition_size consecutive ranks (all ranks
    one node when that is 1). Every error is raised by resolve(), before any collective."""
    if mesh is not None:
        comm = mesh.world
    plan = resolve(config, _world_size(comm), model, model_parameters,
                   node_size=mesh.node_size if mesh is not None else None, device=_device(comm),
                   client_optimizer=client_optimizer, client_scheduler=client_scheduler)
    if plan.pp_size > 1:
        return PipelineEngine(model, plan, comm or comm_mod.get())
    return Engine(model, plan, comm or comm_mod.get(), mesh)


_ENGINES = weakref.WeakSet()  # the live engines: one's backward may run through another's model


class Engine(BaseEngine):
    def __init__(self, model: torch.nn.Module, plan: EnginePlan, comm, mesh=None):
        super().__init__()           # an nn.Module, as DeepSpeed's engine (runtime/trainer.py)
        # the resolved config (runtime/resolve.py): the chain below is a function of it
        self.plan = plan
        self.comm = comm  # every rank of the job: votes (fp16 overflow), norms, checkpoints
        self.stage = plan.stage      # the ZeRO stage
        self.dtype = plan.dtype      # fp32, fp16 or bf16
        self.mixed_precision = plan.mixed_precision  # fp16 or bf16 parameters, fp32 masters
        # one rank per GPU (comm picks it); move your batches there, as in DeepSpeed
        self.device = comm.device
        self.zero_init = plan.zero_init  # built under zero.Init: FSDP materializes it unit by unit
        # what a checkpoint maps back to (before TP splits
        # the model and ZeRO-3 removes its parameters)
        _, self.aliases, self.state_dict_keys, self.param_shapes = chain.model_names(model)
        self.mesh = chain.build_mesh(plan, comm)
        model = chain.apply_tensor_parallel(model, plan, self.mesh)
        chain.apply_sparse_attention(model, plan)
        chain.apply_context_parallel(model, plan, self.mesh)
        chain.apply_expert_parallel(model, plan, self.mesh)
        # the plain model (DeepSpeed's engine.module); with TP its parallel version
        self.module = model
        # {id(parameter): name} of what this rank holds
        self.name_of, _, _, _ = chain.model_names(model)
        # TP: slices
        self.local_shapes = {n: tuple(p.shape) for n,
                             p in model.named_parameters() if p.requires_grad}
        # how TP cut each parameter it splits: {name: [dim,
        # chunks]} (tensor.layers.unshard puts it back)
        self.tp_split = {n: [p.tensor_parallel_dim, p.tensor_parallel_chunks]
                         for n, p in model.named_parameters(remove_duplicate=False)
                         if hasattr(p, "tensor_parallel_dim")}
        # TP's split blocks stay so
        self.checkpointed_blocks = chain.apply_activation_checkpointing(model, plan)
        # the ranks that reduce the gradients (and shard ZeRO's states): dp, or dp x cp with
        # sequence parallelism
        self.dp_comm = (
            (self.mesh.dp_cp if plan.cp_size > 1 else self.mesh.dp) if self.mesh else comm
        )
        # the ranks that split the batch (a cp group shares rows)
        batch_comm = self.mesh.dp if self.mesh else comm
        # which micro-batch is this rank's
        self.dp_rank, self.dp_size = batch_comm.rank, batch_comm.size
        chain.apply_precision(model, plan, self.device)
        strategy = chain.select_strategy(plan, model, self.dp_comm, self.mesh, node_mesh=mesh)
        self.node_mesh = strategy.spec.node_mesh  # ZeRO++'s or hybrid sharding's nodes, or None
        from minizero.precision import LossScaler
        self._attach(strategy,
                     [self.mesh.tp] if self.mesh is not None and self.mesh.tp_size > 1 else [],
                     LossScaler(**plan.loss_scaler) if plan.loss_scaler is not None else None)
        self.timings = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.outputs = None       # the last forward's full output
        self._fwd = self._bwd = 0.0
        _ENGINES.add(self)

    # ------------------------------------------------------------------ the loop
    def __call__(self, *args, **kwargs):
        """The model's forward on this rank's micro-batch. `engine(batch)` with one (x, y) tuple
        works too. Returns the loss when the model returns one ((out, loss), or .loss), else the
        outputs."""
        t0 = time.perf_counter()
        if len(args) == 1 and not kwargs and isinstance(args[0], (tuple, list)):
            args = tuple(args[0])
        if self.mixed_precision:
            cast = lambda t: (  # noqa: E731
                t.to(self.dtype) if torch.is_tensor(t) and t.is_floating_point() else t
            )
            args, kwargs = [cast(a) for a in args], {k: cast(v) for k, v in kwargs.items()}
        self.strategy.forward_prelude()
        self.outputs = out = self.wrapped(*args, **kwargs)
        self._fwd += time.perf_counter() - t0
        loss = (
            out.get("loss")
            if isinstance(out, dict)
            else out[-1]
            if isinstance(out, (tuple, list)) and out
            else getattr(out, "loss", None)
        )
        return loss if torch.is_tensor(loss) and loss.dim() == 0 else out

    forward = __call__

    def backward(self, loss: torch.Tensor):
        """loss / gradient_accumulation_steps (x the loss scale under fp16), then backward. DDP's
        backward before the boundary only accumulates locally (no_sync). Several backwards before
        one step() add up, as DeepSpeed's; the other engines' models this backward runs through keep
        their gradients out of their reductions (Strategy.hold_gradients)."""
        t0 = time.perf_counter()
        if self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        with (
            self.strategy.backward_context(self.is_gradient_accumulation_boundary()),
            ExitStack() as others,
        ):
            # a GAN's generator loss through the discriminator's engine
            for other in list(_ENGINES):
                if other is not self and other.strategy is not None:  # (a destroyed one holds none)
                    others.enter_context(other.strategy.hold_gradients())
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
        # DPU: the step in flight lands now (its parameters go to the device)
        self.strategy.finish_offload()
        grads = self.strategy.reduced_grads()
        self.overflow = False
        if self.loss_scaler is not None:
            self.overflow = self.loss_scaler.unscale_and_check(grads.sharded + grads.replicated,
                                                               self.comm)
            self.loss_scaler.update(self.overflow)  # raises MinLossScaleError at the floor
        if self.overflow:
            self.skipped_steps += 1
        self.apply_step(grads)
        self.timings = {"forward": self._fwd, "backward": self._bwd,
                        "step": time.perf_counter() - t0}
        self._fwd = self._bwd = 0.0

    def weight_of(self):
        """name -> its weight in the global norm (trainer.py), or None when every element counts
        once."""
        if self.mesh is None or self.mesh.tp_size == 1 and self.mesh.ep_size == 1:
            return None
        t, split = self.mesh.tp_size, self.tp_split
        expert = self.strategy.expert_names(self.param_names)
        copies = self.mesh.dp_size // self.mesh.ep_size
        # an expert's gradient is held whole by the dp/ep ranks
        # of its expert_dp group: summed over the world once
        return lambda name: (1.0 if name in split else 1.0 / t) / (copies if name in expert else 1)

    def extras(self) -> dict:
        frozen = [(n, p) for n, p in self.module.named_parameters() if not p.requires_grad]
        return dict(frozen + list(self.module.named_buffers()))
