"""What every engine shares, held by composition: the counters, the LR scheduler, DeepSpeed's
accessors and the one global-norm clip.

    engine.core = TrainerCore(plan, optimizer, loss_scaler)     # Engine and PipelineEngine alike
    @shares_core                                                 # engine.global_steps, engine.get_lr(), ...
    class Engine: ...                                            # read and write engine.core's

The clip (torch.nn.utils.clip_grad_norm_'s coefficient, max_norm / (||g|| + 1e-6) capped at 1) needs
||g|| of the whole model while each rank holds only part of it:
    ||g||^2 = sum over every rank of sum_sharded w g^2  +  sum over pp and tp ranks of sum_replicated w g^2
(sharded pieces differ on every rank; replicated gradients are equal over dp and differ over pp and tp)
with w = 1 for an element counted here, 1/t for a tensor every tp rank holds whole (LayerNorms, wpe),
0 for a tied copy another stage counts (runtime/strategies.norm_weights). precision.clip_grad_norm_ is
that formula; this module only calls it with the engine's groups.
"""
from __future__ import annotations

from minizero.precision import clip_grad_norm_
from minizero.runtime.schedulers import build_scheduler

SHARED = ("config", "lr_scheduler", "global_steps", "global_samples", "micro_steps", "skipped_steps", "overflow",
          "grad_norm", "timings", "train_batch_size", "train_micro_batch_size_per_gpu",
          "gradient_accumulation_steps", "is_gradient_accumulation_boundary", "get_lr", "lr", "loss_scale",
          "get_global_grad_norm", "was_step_applied", "loss_scaler")


class TrainerCore:
    def __init__(self, config: dict, optimizer, loss_scaler=None):
        self.config = config            # the checked config (runtime/config.py)
        self.optimizer = optimizer      # what the scheduler edits (a torch.optim.Optimizer)
        self.loss_scaler = loss_scaler  # fp16's LossScaler, or None
        self.lr_scheduler = build_scheduler(optimizer, config["scheduler"])
        self.global_steps = 0     # optimizer steps, skipped ones included (DeepSpeed's count)
        self.global_samples = 0   # samples seen, over all ranks
        self.micro_steps = 0      # backward passes
        self.skipped_steps = 0    # fp16 overflows
        self.overflow = False     # the last step was skipped
        self.grad_norm = None     # the last step's global gradient norm
        self.timings = {}         # seconds spent in the last optimizer step, by phase

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

    # ------------------------------------------------------------------ the step's shared parts
    def clip(self, grads, weights, shard_comm, model_comms) -> float:
        """Clip the reduced gradients (strategies.Grads) by the global norm; returns it (module docstring)."""
        norm = clip_grad_norm_(grads.sharded, self.config["gradient_clipping"], shard_comm, replicated=grads.replicated,
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
