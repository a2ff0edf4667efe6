"""What every engine shares: BaseEngine (the strategy's step, the clip, measurements, checkpoints), and in
it the TrainerCore (counters, the LR scheduler, DeepSpeed's accessors).

    class Engine(BaseEngine): ...            # runtime/engine.py: forward, backward, step
    class PipelineEngine(BaseEngine): ...    # runtime/pipeline_engine.py: train_batch, a schedule by composition
    engine.global_steps, engine.get_lr()     # engine.core's (shares_core)

The clip (torch.nn.utils.clip_grad_norm_'s coefficient, max_norm / (||g|| + 1e-6) capped at 1) needs
||g|| of the whole model while each rank holds only part of it:
    ||g||^2 = sum over every rank of sum_sharded w g^2  +  sum over pp and tp ranks of sum_replicated w g^2
(sharded pieces differ on every rank; replicated gradients are equal over dp and differ over pp and tp)
with w = 1 for an element counted here, 1/t for a tensor every tp rank holds whole (LayerNorms, wpe),
0 for a tied copy another stage counts (runtime/strategies.norm_weights). precision.clip_grad_norm_ is
that formula; this module only calls it with the engine's groups.
"""
from __future__ import annotations

from minizero import memory
from minizero.precision import clip_grad_norm_
from minizero.runtime import checkpoint
from minizero.runtime.schedulers import build_scheduler
from minizero.runtime.strategies import Strategy, norm_weights

SHARED = ("config", "lr_scheduler", "global_steps", "global_samples", "micro_steps", "skipped_steps", "overflow",
          "grad_norm", "timings", "train_batch_size", "train_micro_batch_size_per_gpu",
          "gradient_accumulation_steps", "is_gradient_accumulation_boundary", "get_lr", "lr", "loss_scale",
          "get_global_grad_norm", "was_step_applied", "loss_scaler")


class TrainerCore:
    def __init__(self, plan, optimizer, loss_scaler=None):
        self.plan = plan                # the resolved plan (runtime/resolve.py)
        self.config = plan.config       # the checked config, as DeepSpeed's engine.config
        self.optimizer = optimizer      # what the scheduler edits (a torch.optim.Optimizer)
        self.loss_scaler = loss_scaler  # fp16's LossScaler, or None
        self.lr_scheduler = build_scheduler(optimizer, plan.scheduler)
        self.global_steps = 0     # optimizer steps, skipped ones included (DeepSpeed's count)
        self.global_samples = 0   # samples seen, over all ranks
        self.micro_steps = 0      # backward passes
        self.skipped_steps = 0    # fp16 overflows
        self.overflow = False     # the last step was skipped
        self.grad_norm = None     # the last step's global gradient norm
        self.timings = {}         # seconds spent in the last optimizer step, by phase

    # ------------------------------------------------------------------ DeepSpeed's accessors
    def train_batch_size(self) -> int:
        return self.plan.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.plan.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.plan.gradient_accumulation_steps

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

    # ------------------------------------------------------------------ the step's shared parts
    def clip(self, grads, weights, shard_comm, model_comms) -> float:
        """Clip the reduced gradients (strategies.Grads) by the global norm; returns it (module docstring)."""
        norm = clip_grad_norm_(grads.sharded, self.plan.gradient_clipping, shard_comm, replicated=grads.replicated,
                               weights=weights[0], replicated_weights=weights[1], model_comms=model_comms)
        self.grad_norm = norm.item()
        return self.grad_norm

    def stepped(self, micro_steps: int = 0):
        """An optimizer step (applied or skipped) is over: the scheduler (when applied) and the counters."""
        if not self.overflow and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.micro_steps += micro_steps
        self.global_steps += 1
        self.global_samples += self.train_batch_size()


class _Shared:
    """engine.NAME reads (and writes) engine.core.NAME."""

    def __init__(self, name):
        self.name = name

    def __get__(self, engine, owner=None):
        return self if engine is None else getattr(engine.core, self.name)

    def __set__(self, engine, value):
        setattr(engine.core, self.name, value)


def shares_core(cls):
    """Class decorator: every name in SHARED is the engine's core's."""
    for name in SHARED:
        setattr(cls, name, _Shared(name))
    return cls


@shares_core
class BaseEngine:
    """What the plain and the pipeline engine share, around one data-parallel strategy (strategies.Strategy).
    A subclass sets plan, world, comm, device, mesh, dp_comm, dp_rank, dp_size, module and the names a
    checkpoint maps back to (name_of, aliases, state_dict_keys, param_shapes, local_shapes, tp_split,
    tied_names), then calls _attach(strategy, model_comms)."""

    tied_names: set = frozenset()  # a pipeline's later-stage copies of a tied weight (saved as name@pp{s})

    def _attach(self, strategy: Strategy, model_comms: list, loss_scaler=None):
        """model_comms: the groups over which replicated gradients differ (pp stages, tp ranks)."""
        self.strategy = strategy
        self.wrapped = strategy.wrapped
        self.offload = strategy.offload
        self.optimizer = strategy.optimizer  # a torch.optim.Optimizer (offloaded: it drives the tier)
        self.param_names = strategy.param_names(self.name_of)  # checkpoints name each trained tensor
        self.model_comms = model_comms
        self.core = TrainerCore(self.plan, self.optimizer, loss_scaler)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # ------------------------------------------------------------------ the step's shared parts
    def weight_of(self):
        """name -> its weight in the global norm (module docstring), or None when every element counts once."""
        return None

    def clip(self, grads) -> float:
        weight_of = self.weight_of()
        weights = norm_weights(grads, self.strategy.grad_names(self.param_names) if weight_of else None,
                               weight_of, self.device)
        return self.core.clip(grads, weights, self.strategy.norm_comm(self.world),
                              self.model_comms if self.strategy.has_replicated else [])

    def apply_step(self, grads, micro_steps: int = 0):
        """Clip (unless the step overflowed), step the strategy, count, zero the gradients."""
        if not self.overflow:
            if self.plan.gradient_clipping > 0:
                self.clip(grads)
            self.strategy.apply()
        self.core.stepped(micro_steps)
        self.strategy.zero_grad()

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

    # ------------------------------------------------------------------ checkpoints (runtime/checkpoint.py)
    def save_checkpoint(self, save_dir, tag=None, client_state=None):
        """Every rank writes its shard; a collective. client_state: plain data (numbers, strings, lists,
        dicts, tensors), handed back by load_checkpoint."""
        self._check_checkpointable()
        self.strategy.finish_offload()  # DPU: the checkpoint holds the update in flight
        return checkpoint.save(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir, tag=None):
        """-> (path, client_state), as DeepSpeed. Validates everything on every rank before changing anything."""
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

    def _check_checkpointable(self):
        """Every rank alike, before any collective: the checkpoint format has no key for an expert slice."""
        if self.plan.ep_size > 1:
            raise NotImplementedError(f"checkpoints of an engine with expert parallelism (ep_size={self.plan.ep_size}) "
                                      "are not implemented: each ep rank holds other experts under the same names, "
                                      "and the format keys only tensor-parallel slices (name@tp{k})")

    def checkpoint_layout(self) -> dict:
        """How this job's ranks split the model: tp slices are saved under name@tp{k}."""
        return {"dp": self.dp_size, "pp": self.plan.pp_size, "tp": self.plan.tp_size, "tp_split": self.tp_split}

    def checkpoint_key(self, name: str) -> str:
        """The key this rank saves parameter `name` under."""
        key = name if self.plan.tp_size == 1 else f"{name}@tp{self.mesh.tp_rank}"
        return f"{key}@pp{self.mesh.pp_rank}" if name in self.tied_names else key

    def checkpoint_keys(self) -> list:
        """[(key, shape)] of every trained tensor this rank holds a part of."""
        return [(self.checkpoint_key(n), list(s)) for n, s in self.local_shapes.items()]

    def writes(self, segment) -> bool:
        """Whether this rank writes a segment of its strategy (a replicated one is written once)."""
        return self.strategy.writes(segment)

    def saves_extras(self) -> bool:
        """Whether this rank writes the frozen parameters and buffers (one rank of the replicas does)."""
        return self.dp_comm.rank == 0 and (self.mesh is None or self.mesh.tp_rank == 0)

    def extras(self) -> dict:
        """Frozen parameters and buffers (replicated, not trained, still the model's), by name."""
        raise NotImplementedError
