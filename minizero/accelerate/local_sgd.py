"""accelerate.local_sgd.LocalSGD on minizero's engine (docs/accelerate.md).

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in train_dl:
            ...; optimizer.step(); local_sgd.step()

Inside the block each rank steps on its own gradients (the engine's DDP reduces nothing); every
local_sgd_steps calls of step(), and when the block ends, the ranks' parameters are averaged.
Each rank's optimizer state stays its own, as in Accelerate.
"""
from __future__ import annotations

import contextlib

import torch

from minizero.accelerate.utils import DistributedType
from minizero.runtime.config import ConfigError


class LocalSGD:
    def __init__(self, accelerator, model, local_sgd_steps: int, enabled: bool = True):
        kind = accelerator.distributed_type
        if kind not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            raise ConfigError(f"LocalSGD under {kind.value} is not covered (nor by Accelerate): "
                              "it averages whole parameters, so DDP (MULTI_CPU / MULTI_GPU) only")
        if enabled and (not isinstance(local_sgd_steps, int) or local_sgd_steps < 1):
            raise ConfigError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): use a whole number "
                              ">= 1")
        self.enabled = enabled and accelerator.num_processes > 1
        self.accelerator, self.model, self.local_sgd_steps = accelerator, model, local_sgd_steps
        self.num_steps = 0
        self._held = None
        if not self.enabled:
            return
        engine = getattr(model, "engine", None)
        strategy = getattr(engine, "strategy", None)
        if getattr(strategy, "ddp", None) is None:
            raise ConfigError("LocalSGD(model=...): pass the model accelerator.prepare() returned "
                              "(with its optimizer), trained with DDP")
        if strategy.spec.mixed_precision:
            # the engine would keep stepping its fp32 masters, which averaging the model misses
            raise ConfigError("LocalSGD with the engine's fp32 master weights is not covered: "
                              "use fp32 or autocast mixed precision (Accelerate's DDP default)")
        self._ddp = strategy.ddp

    def __enter__(self):
        if self.enabled:
            # torch DDP's no_sync for the whole block: every backward keeps its local gradient, and
            # the engine's step finds nothing pending, so it steps on that local gradient
            self._held = contextlib.ExitStack()
            self._held.enter_context(self._ddp.no_sync())
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.enabled:
            try:
                if exc_type is None:
                    self._average()
            finally:
                self._held.close()
        return False

    def step(self):
        """After each optimizer step: average the parameters every local_sgd_steps calls."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    @torch.no_grad()
    def _average(self):
        self.accelerator.wait_for_everyone()
        for p in self.model.parameters():
            p.copy_(self.accelerator.reduce(p.detach(), reduction="mean"))
