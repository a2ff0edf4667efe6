"""0/1 Adam (Lu et al. 2022, "Maximizing Communication Efficiency for Large-scale Training via 0/1
Adam"): 1-bit Adam without a fixed warm-up, and with local steps once the variance is frozen.
DeepSpeed's ZeroOneAdam (deepspeed/runtime/fp16/onebit/zoadam.py); lab 13's stretch task writes its
policy (ZeroOnePolicy.advance).

Two phases, split at var_freeze_step (DeepSpeed's default 100000: usually the end of the
learning-rate warm-up):

  adaptive variance freezing, steps 1..var_freeze_step: on a variance step (step % var_interval ==
      0) the gradients are all-reduced in fp32 and both m and v are updated; on every other step v
      is left as it is and the gradient is all-reduced in 1 bit (compressed_allreduce) into m. The
      interval starts at 1 and doubles after every var_update_scaler variance steps (the paper's
      kappa): the variance is refreshed at steps 1..k, then every 2nd step k times, every 4th k
      times, ...
  local steps, every later step: no communication but at a sync step (step % local_interval == 0).
      Each rank folds its own gradient into m and steps its own parameters; the sync undoes the
      local updates, sums them (sum over the steps of lr·m, scaled back by sqrt(v) + eps),
      all-reduces that in 1 bit, and applies the average: every rank holds the same parameters again
      and m = that average over the lrs summed. The interval starts at 1 and doubles (up to
      local_step_clipper, the paper's H) every local_step_scaler steps. The error buffers are
      zeroed once when the local steps begin (DeepSpeed's reinitial_error_buffer).

The update is m / (sqrt(v) + eps) with weight decay added to it (Adam's L2), as DeepSpeed's.
Differences from DeepSpeed, on purpose: Adam's bias corrections are kept (as OneBitAdam here: m's by
the step, v's by the number of variance updates; without them v, refreshed rarely from zero, is too
small and a short run diverges), so the sync averages the step sizes lr / (1 - beta1^step) that the
local steps used; its first step() call only initialises its buffers (here the first
call steps, as OneBitAdam here); its freeze takes effect one step after step > var_freeze_step (here
at var_freeze_step + 1); all parameters are communicated as ONE flat buffer (one scale per chunk for
all of them, 2 collectives a step, as OneBitAdamStrategy), not one per tensor.

Bytes one rank sends at a step (bytes_at), n parameters, N ranks: a variance step 2(N-1)/N 4n (fp32
all-reduce); a 1-bit step and a sync step 2(N-1)/N (n/8 + 4N) for n padded to 8N
(onebit.bytes_compressed); a local step 0.
"""
from __future__ import annotations

import torch

from minizero.compression.onebit import (
    bytes_allreduce,
    bytes_compressed,
    compressed_allreduce,
    padded_numel,
)


class ZeroOnePolicy:
    """When 0/1 Adam refreshes the variance and when, once it is frozen, the ranks synchronise."""

    def __init__(self, var_freeze_step=100000, var_update_scaler=16, local_step_scaler=32678,
                 local_step_clipper=16):
        for name, value in (("var_freeze_step", var_freeze_step),
                            ("var_update_scaler", var_update_scaler),
                            ("local_step_scaler", local_step_scaler),
                            ("local_step_clipper", local_step_clipper)):
            if (not isinstance(value, int) or isinstance(value, bool)
                    or value < (0 if name == "var_freeze_step" else 1)):
                raise ValueError(f"{name} must be an int >= "
                                 f"{0 if name == 'var_freeze_step' else 1}, got {value!r}")
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.var_interval, self.var_counter = 1, 0  # variance refreshed every var_interval steps
        # frozen: synchronise every local_interval steps
        self.local_interval, self.local_counter = 1, 0

    def frozen(self, step: int) -> bool:
        return step > self.var_freeze_step

    def variance_step(self, step: int) -> bool:
        """This step all-reduces the gradients in fp32 and updates v (and m)."""
        return not self.frozen(step) and step % self.var_interval == 0

    def sync_step(self, step: int) -> bool:
        """This (frozen) step all-reduces the ranks' summed local updates in 1 bit."""
        return self.frozen(step) and step % self.local_interval == 0

    def advance(self, step: int) -> None:
        """Step `step` is over: the intervals for the next ones."""
        # BEGIN SOLUTION: 0/1 Adam's policy (stretch), after step `step`.
        #   What must hold: the schedule of the module docstring, which is DeepSpeed's (the grader
        #   compares schedule() over long runs and several settings). Before the freeze, the
        #   variance steps (variance_step) come at steps 1..k, then every 2nd step k times, every
        #   4th k times, ..., k = var_update_scaler: only variance steps count towards a doubling.
        #   Once frozen, the sync interval starts at 1 and doubles every local_step_scaler steps,
        #   every step counting, and never exceeds local_step_clipper. advance(step) runs once after
        #   each step; the next step's variance_step and sync_step read the intervals, so a doubling
        #   takes effect from the very next step, neither earlier nor later. The state is the two
        #   intervals and the two counters set in __init__ (schedule() replays a fresh policy).
        if not self.frozen(step):
            if step % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
        else:
            self.local_counter += 1
            if self.local_counter == self.local_step_scaler:
                self.local_counter = 0
                self.local_interval = min(self.local_step_clipper, self.local_interval * 2)
        # END SOLUTION

    def schedule(self, steps: int) -> list[str]:
        """What each of steps 1..steps does ("variance", "1-bit", "local", "sync"), on a fresh copy
        of the policy."""
        policy = type(self)(self.var_freeze_step, self.var_update_scaler, self.local_step_scaler,
                            self.local_step_clipper)
        out = []
        for step in range(1, steps + 1):
            out.append("variance" if policy.variance_step(step)
                       else "sync" if policy.sync_step(step)
                       else "local" if policy.frozen(step) else "1-bit")
            policy.advance(step)
        return out


def bytes_at(kind: str, numel: int, world: int) -> float:
    """Bytes one rank sends at a step of this kind (ZeroOnePolicy.schedule)."""
    return {"variance": bytes_allreduce(numel, world), "1-bit": bytes_compressed(numel, world),
            "sync": bytes_compressed(numel, world), "local": 0.0}[kind]


class ZeroOneAdam(torch.optim.Optimizer):
    """0/1 Adam over `comm` (the data-parallel group): the gradients are this rank's own (no DDP
    reduction); the optimizer communicates (module docstring). cuda_aware and comm_backend_name:
    DeepSpeed's keys, accepted as OneBitAdam takes them (the Communicator is the one transport)."""

    def __init__(self, params, comm, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 var_freeze_step=100000, var_update_scaler=16, local_step_scaler=32678,
                 local_step_clipper=16, cuda_aware=False, comm_backend_name="nccl",
                 allreduce=compressed_allreduce, policy=ZeroOnePolicy):
        super().__init__(params,
                         dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.comm, self.allreduce = comm, allreduce
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name
        self.policy = policy(var_freeze_step, var_update_scaler, local_step_scaler,
                             local_step_clipper)
        self.steps_done, self.lrs, self.variance_updates = 0, 0.0, 0
        self.params = [p for g in self.param_groups for p in g["params"]]
        n = sum(p.numel() for p in self.params)
        self.numel, self.padded = n, padded_numel(n, comm.size)
        device = self.params[0].device
        self.exp_avg, self.exp_avg_sq = torch.zeros(n, device=device), torch.zeros(n, device=device)
        # the local steps' summed updates, -sum lr·update
        self.comm_buffer = torch.zeros(n, device=device)
        self.worker_error = torch.zeros(self.padded, device=device)
        self.server_error = torch.zeros(self.padded // comm.size, device=device)

    def _compressed_mean(self, flat: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return flat.clone()
        padded = torch.zeros(self.padded, device=flat.device)
        padded[:self.numel] = flat
        return self.allreduce(padded, self.comm, self.worker_error, self.server_error)[:self.numel]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps_done += 1
        step, policy = self.steps_done, self.policy
        group = self.param_groups[0]  # one lr and betas for all (a flat buffer)
        lr, (beta1, beta2), eps, wd = (group["lr"], group["betas"], group["eps"],
                                       group["weight_decay"])
        p_flat = torch.cat([p.reshape(-1) for p in self.params])
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                       for p in self.params])
        m, v = self.exp_avg, self.exp_avg_sq
        if policy.variance_step(step):
            if self.comm.size > 1:
                self.comm.all_reduce(g, op="avg")
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            self.variance_updates += 1
        elif not policy.frozen(step):
            m.mul_(beta1).add_(self._compressed_mean(g), alpha=1 - beta1)
        else:
            # the local steps begin: the errors start again from zero
            if not policy.frozen(step - 1):
                self.worker_error.zero_()
                self.server_error.zero_()
            m.mul_(beta1).add_(g, alpha=1 - beta1)  # this rank's own gradient
        step_size = lr / (1 - beta1 ** step)
        denom = (v.sqrt() / (1 - beta2 ** max(self.variance_updates, 1)) ** 0.5).add_(eps)
        update = m / denom
        if wd:
            update += wd * p_flat
        p_flat.add_(update, alpha=-step_size)
        if policy.frozen(step):
            self.lrs += step_size
            self.comm_buffer.add_(update, alpha=-step_size)
            # undo the local updates, average them in 1 bit, apply the average
            if policy.sync_step(step):
                p_flat.sub_(self.comm_buffer)
                self.comm_buffer.mul_(denom)
                self.comm_buffer.copy_(self._compressed_mean(self.comm_buffer))
                m.copy_(self.comm_buffer / -self.lrs)
                p_flat.add_(self.comm_buffer / denom)
                self.comm_buffer.zero_()
                self.lrs = 0.0
        for p, part in zip(self.params, p_flat.split([p.numel() for p in self.params])):
            p.copy_(part.view_as(p))
        policy.advance(step)
        return loss

    def bytes_per_step(self, steps: int) -> list[float]:
        """The bytes this rank sends at each of steps 1..steps, by formula (the reference policy's
        schedule)."""
        p = self.policy
        return [bytes_at(kind, self.numel, self.comm.size) for kind in
                ZeroOnePolicy(p.var_freeze_step, p.var_update_scaler, p.local_step_scaler,
                              p.local_step_clipper).schedule(steps)]
