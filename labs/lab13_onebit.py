# Lab 13: 1-bit Adam: error-compensated 1-bit compression and its all-reduce
# GENERATED from minizero/compression/onebit.py + minizero/compression/zero_one_adam.py by `make labs`. Edit the TODO regions (everything else is the reference code).
#   run:   mpirun -n 4 python labs/lab13_onebit.py
#   check: python -m minizero_course grade --lab 13 --impl labs    (or: pytest -m lab13 --impl labs)
"""1-bit compression with error feedback, and the compressed all-reduce built on it (Tang et al.
2021).

A tensor x of n elements (padded with zeros to a multiple of 8N, so each rank's chunk packs into
whole bytes) is sent as its signs, one bit each, and ONE scale:

    c = x + e                        e: what earlier compressions of this buffer got wrong
                                     (error feedback)
    scale = ||c||_2 / sqrt(n)        the RMS of c: sign(c) * scale has the same L2 norm as c
    x' = scale * sign(c)             sign(0) counts as +1 (a bit has two values)
    e <- c - x'                      kept for the next call: what was lost is added back next time

Without e every call rounds the same way and the error accumulates as a bias; with it, the sum of
the compressed values over T calls differs from the sum of the true values by one e, which stays
bounded, so their average converges (tests/test_onebit.py measures both).

compressed_allreduce (DeepSpeed's NcclBackend.compressed_allreduce, deepspeed/runtime/comm/nccl.py):
the average of every rank's x, as a reduce-scatter and an all-gather, each 1-bit:
  1. every rank compresses its whole x (worker error, one worker scale) and sends chunk j of the
     signs, with its scale, to rank j: one all-to-all;
  2. rank j decodes the N chunks it got, averages them, and compresses that average (server error
     of chunk j, one server scale): it is the "server" of chunk j;
  3. every rank's compressed chunk, with its scale, is all-gathered and decoded.
Signs and scale travel as ONE byte message per chunk (two collectives, two latencies, not four as in
DeepSpeed, which all-gathers the scales separately; the bytes are the same). Bytes one rank sends,
ring model (comm/stats.py), for n padded elements:
    all-to-all (N-1)/N (n/8 + 4N)  +  all-gather (N-1)/N (n/8 + 4N)   = 2(N-1)/N (n/8 + 4N)
against 2(N-1)/N 4n for an fp32 all-reduce: 1 bit + the scales instead of 32 bits
(bytes_compressed).
"""
from __future__ import annotations

import math

import torch

from minizero.comm.labels import labelled

FP32_BYTES = 4
SCALE_BYTES = 4  # one fp32 scale per compressed chunk
_BIT_WEIGHTS = [1 << i for i in range(8)]


def padded_numel(numel: int, world: int) -> int:
    """numel rounded up so each of the `world` chunks packs into whole bytes (a multiple of 8N)."""
    step = 8 * world
    return -(-numel // step) * step


def bytes_allreduce(numel: int, world: int, elem_bytes: int = FP32_BYTES) -> float:
    """Bytes one rank sends to all-reduce `numel` elements uncompressed (ring)."""
    return 2 * (world - 1) / world * elem_bytes * numel if world > 1 else 0.0


def bytes_compressed(numel: int, world: int) -> float:
    """Bytes one rank sends for compressed_allreduce of `numel` elements: signs (1 bit per padded
    element) and N scales, once in the all-to-all and once in the all-gather."""
    if world == 1:
        return 0.0
    return 2 * (world - 1) / world * (padded_numel(numel, world) / 8 + SCALE_BYTES * world)


def pack_signs(c: torch.Tensor) -> torch.Tensor:
    """Bits (c >= 0), 8 to a uint8, element i in bit i % 8 of byte i // 8; c.numel() % 8 == 0."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=c.device)
    bits = (c >= 0).view(-1, 8).to(torch.uint8)
    return (bits * weights).sum(dim=1).to(torch.uint8)  # distinct bits: the sum is their OR


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """pack_signs undone, as +1.0 / -1.0 (float32)."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = packed.view(-1, 1).bitwise_and(weights).ne(0).reshape(-1)
    return bits.float().mul_(2).sub_(1)


def compress(x: torch.Tensor, error: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs, scale) of x + error, x flat fp32 with numel % 8 == 0. With error feedback
    (`error` a tensor like x) the error is updated in place to what this compression lost; error
    None: no feedback, x alone is compressed."""
    # TODO(lab 13): 1-bit compression with error feedback.
    #   What must hold: the module docstring's four lines. The receiver sees scale * sign(c), and
    #   that has c's L2 norm only if the scale is c's RMS (over all its elements). sign(0) counts as
    #   +1: a bit has two values, and pack_signs already packs c >= 0 that way (unpack_signs gives
    #   +1.0 / -1.0 back). With feedback, `error` is the caller's buffer, kept from call to call: it
    #   must be updated IN PLACE to exactly what this compression lost, measured against the values
    #   the receiver will decode. x itself is never changed; error None: no feedback, x alone is
    #   compressed.
    #   Returns (packed signs, uint8 [numel / 8]; scale, a 1-element fp32 tensor).
    raise NotImplementedError('lab 13: not implemented yet: 1-bit compression with error feedback')


def _message(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One chunk on the wire: its sign bytes, then its fp32 scale's 4 bytes."""
    return torch.cat([packed, scale.float().view(torch.uint8)])


def _decode(message: torch.Tensor) -> torch.Tensor:
    """A _message (or rows of them) back to scale * signs, one row per message."""
    rows = message.view(-1, message.shape[-1])
    scales = rows[:, -SCALE_BYTES:].contiguous().view(torch.float32)  # [rows, 1]
    return unpack_signs(rows[:, :-SCALE_BYTES].contiguous()).view(len(rows), -1) * scales


@labelled("onebit")
def compressed_allreduce(x: torch.Tensor, comm, worker_error: torch.Tensor | None = None,
                         server_error: torch.Tensor | None = None) -> torch.Tensor:
    """The average over ranks of x, each rank's x and each chunk's average sent as 1-bit signs and a
    scale. x: flat fp32 of padded_numel(x.numel(), N) elements; worker_error like x, server_error
    like this rank's chunk (x.numel() // N), both updated in place; None: no error feedback on that
    side. Returns a new tensor like x, the same on every rank."""
    # TODO(lab 13): the compressed all-reduce: a 1-bit all-to-all, then a 1-bit all-gather.
    #   What must hold: the result is the same on every rank, shaped like x, and its chunk j (numel
    #   / N elements) has been compressed twice: once in each worker's x (one scale per worker,
    #   worker_error), then as the average of the N decoded chunks j, on rank j, its "server" (one
    #   scale, server_error, which is chunk-sized). Exactly two collectives, one per compression;
    #   each carries a chunk's signs AND its scale in one byte message, so the bytes are
    #   bytes_compressed's. The packed signs of a chunk are whole bytes of the packed signs of x
    #   (element i is bit i % 8 of byte i // 8; numel is a multiple of 8N).
    #   API: _message(packed, scale) is one chunk's message; _decode(messages) turns [k, bytes]
    #   messages back into [k, elements] values. comm.all_to_all(output, input): dim 0 of input is N
    #   blocks, block j goes to rank j, block j of output came from rank j. comm.all_gather(output,
    #   input): output holds comm.size x input's elements, rank r's at the r-th place.
    raise NotImplementedError('lab 13: not implemented yet: the compressed all-reduce')


# ----------------------------------------------------------------------------- from minizero/compression/zero_one_adam.py
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

import torch



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
        # TODO(lab 13): 0/1 Adam's policy (stretch), after step `step`.
        #   What must hold: the schedule of the module docstring, which is DeepSpeed's (the grader
        #   compares schedule() over long runs and several settings). Before the freeze, the
        #   variance steps (variance_step) come at steps 1..k, then every 2nd step k times, every
        #   4th k times, ..., k = var_update_scaler: only variance steps count towards a doubling.
        #   Once frozen, the sync interval starts at 1 and doubles every local_step_scaler steps,
        #   every step counting, and never exceeds local_step_clipper. advance(step) runs once after
        #   each step; the next step's variance_step and sync_step read the intervals, so a doubling
        #   takes effect from the very next step, neither earlier nor later. The state is the two
        #   intervals and the two counters set in __init__ (schedule() replays a fresh policy).
        raise NotImplementedError("lab 13: not implemented yet: 0/1 Adam's policy (stretch), after step `step`")

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


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(13, globals())
