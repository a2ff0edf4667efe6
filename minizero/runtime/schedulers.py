"""DeepSpeed's learning-rate schedules, with DeepSpeed's parameter names and formulas.

    lr(t) for optimizer step t = 0, 1, 2, ...   (warmup over W = warmup_num_steps steps)
    warmup gamma:  "log"    -> log(t + 1) / log(W)       (DeepSpeed's default)
                   "linear" -> t / W
    WarmupLR        min_lr + (max_lr - min_lr) * gamma, then max_lr
    WarmupDecayLR   as WarmupLR, then max_lr * (T - t) / (T - W) down to 0 at T = total_num_steps
    WarmupCosineLR  ratios of the optimizer's own lr: warmup_min_ratio -> 1 during warmup, then
                    cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * (t - W + 1) / (T - W))) / 2

One deliberate choice: the schedule writes lr(0) into the optimizer at construction, so the
first step uses the schedule's value (not the optimizer's constructor lr). `step()` is
called once per optimizer step (the engine does it at each accumulation boundary).
"""
from __future__ import annotations

import math


class _Schedule:
    def __init__(self, optimizer, warmup_num_steps, warmup_type):
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, int(warmup_num_steps))  # log(1) = 0 would divide by zero
        self.warmup_type = warmup_type
        # DeepSpeed's start (deepspeed/runtime/lr_schedules.py, last_batch_iteration=-1): the first
        # optimizer step runs at the start value (min lr, ratio 0) and the engine's scheduler.step()
        # after it moves to t = 0, so the learning rates of steps 1, 2, 3 are lr(-1), lr(0), lr(1):
        # 0, 0, then the warm-up's first rise
        self.last_batch_iteration = -1
        self._apply()

    def _warmup_gamma(self, t):
        # DeepSpeed's rounding: its stored 1 / log(W), times log(t + 1)
        if self.warmup_type == "log":
            return (1.0 / math.log(self.warmup_num_steps)) * math.log(t + 1)
        return t / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self):
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr

    def step(self):
        self.last_batch_iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd):
        self.last_batch_iteration = sd["last_batch_iteration"]
        self._apply()


class WarmupLR(_Schedule):
    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log"):
        self.min_lr, self.max_lr = warmup_min_lr, warmup_max_lr
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def _gamma(self, t):
        if t < 0:  # before the first scheduler step: the minimum (DeepSpeed's get_lr)
            return 0.0
        return self._warmup_gamma(t) if t < self.warmup_num_steps else 1.0

    def get_lr(self):
        lr = self.min_lr + (self.max_lr - self.min_lr) * self._gamma(self.last_batch_iteration)
        return [lr] * len(self.optimizer.param_groups)


class WarmupDecayLR(WarmupLR):
    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log"):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _gamma(self, t):
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            return self._warmup_gamma(t)
        return max(0.0,
                   (self.total_num_steps - t) / max(1.0,
                                                    self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type="log"):
        self.total_num_steps, self.warmup_min_ratio, self.cos_min_ratio = (
            total_num_steps,
            warmup_min_ratio,
            cos_min_ratio,
        )
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def ratio(self, t):
        warmup = self.warmup_num_steps
        if t < 0:  # before the first scheduler step: 0, as DeepSpeed's get_lr_ratio
            return 0.0
        if t < warmup:
            return self.warmup_min_ratio + (1 - self.warmup_min_ratio) * self._warmup_gamma(t)
        # clamped at the end: past total_num_steps the ratio
        # stays at cos_min_ratio (DeepSpeed clamps too)
        progress = min(1.0, (t - warmup + 1) / max(1, self.total_num_steps - warmup))
        return max(
            0.0,
            self.cos_min_ratio + (1 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2,
        )

    def get_lr(self):
        return [lr * self.ratio(self.last_batch_iteration) for lr in self.base_lrs]


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
              "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(optimizer, spec: dict | None):
    """From a config's `scheduler` section ({type, params}); None -> None."""
    if spec is None:
        return None
    cls = SCHEDULERS[spec["type"]]
    try:
        return cls(optimizer, **spec.get("params", {}))
    except TypeError as e:
        raise ValueError(f"scheduler {spec['type']}: {e}") from None
