"""OneBitAdam: Adam whose momentum, not its gradient, crosses the network in 1 bit (Tang et al.
2021).

Adam's variance v changes slowly once training has settled; the paper's observation is that, frozen,
it makes Adam a momentum SGD with a fixed per-coordinate learning rate, and momentum SGD tolerates
error-compensated 1-bit communication. Two phases, as DeepSpeed's OnebitAdam
(deepspeed/runtime/fp16/onebit/adam.py, OnebitAdam.step):

  warm-up, steps 1..freeze_step: plain Adam on the averaged gradient; the gradients are all-reduced
      in fp32 (by this optimizer, or already by DDP: grads_averaged=True). Equal to torch.optim.Adam
      (AdamW with weight_decay), bit for bit.
  compression, every later step: no gradient all-reduce. Each rank folds its OWN gradient into its
      momentum, m = b1 m + (1 - b1) g, then m is replaced by compressed_allreduce(m) (the average
      over ranks, 1 bit per element, error feedback on both sides), so every rank holds the same m
      again; v stays as it was at freeze_step; the update is Adam's with that m and that v.

Differences from DeepSpeed, on purpose: the update keeps torch Adam's bias correction (DeepSpeed
stores bias_correction but its update is m / (sqrt(v) + eps)), so the warm-up is exactly torch Adam;
weight decay is decoupled (AdamW's p *= 1 - lr wd; DeepSpeed adds wd p to the update, the same
thing); DeepSpeed's first call to step() initialises its buffers and skips the update, this one does
not.

cuda_aware and comm_backend_name are DeepSpeed's config keys and are accepted for its configs: they
pick how DeepSpeed moves the bytes (MPI with or without CUDA-aware buffers, NCCL, or its
"compressed" all-to-all backend). Here the Communicator is the one transport (MPI on CPU, NCCL on
CUDA), so they change nothing; an unknown backend name is refused.

Stages: DeepSpeed refuses OneBitAdam with any ZeRO stage (engine.py, _configure_basic_optimizer:
"1bit-Adam is not compatible with ZeRO"); the momentum must be whole on every rank. This optimizer
runs on a plain replicated model or a DDP one (ZeRO stage 0), fp32 parameters (fp16 training keeps
fp32 masters: step those).

Bytes one rank sends per step (bytes_per_step), n parameters, N ranks:
    warm-up      2(N-1)/N 4n                                      one fp32 all-reduce
    compression  sum over tensors of 2(N-1)/N (n_t/8 + 4N)        (onebit.bytes_compressed)
"""
from __future__ import annotations


import torch

from minizero.compression.onebit import (
    bytes_allreduce,
    bytes_compressed,
    compressed_allreduce,
    padded_numel,
)

COMM_BACKENDS = ("nccl", "mpi", "compressed", "hccl")  # DeepSpeed's comm_backend_name values


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam over `comm` (the data-parallel group). error_feedback=False drops both error
    buffers (the ablation lesson 14 measures); grads_averaged=True: the gradients are averaged
    already (DDP) in the warm-up; set the DDP's require_backward_grad_sync = not opt.compressing
    before each backward. per_tensor=False compresses every momentum as one flat buffer (one worker
    scale for all of them): 2 collectives a step instead of 2 per tensor."""

    def __init__(self, params, comm, lr=1e-3, freeze_step=100000, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, bias_correction=True, amsgrad=False, cuda_aware=False,
                 comm_backend_name="nccl", error_feedback=True, grads_averaged=False,
                 per_tensor=True, allreduce=compressed_allreduce):
        if not isinstance(freeze_step, int) or isinstance(freeze_step, bool) or freeze_step < 0:
            raise ValueError("freeze_step must be an int >= 0 (warm-up steps of plain Adam), got "
                             f"{freeze_step!r}")
        if amsgrad:
            raise ValueError("OneBitAdam: amsgrad is not supported (the variance is frozen after "
                             "freeze_step)")
        if comm_backend_name not in COMM_BACKENDS:
            raise ValueError(f"comm_backend_name must be one of {', '.join(COMM_BACKENDS)}, got "
                             f"{comm_backend_name!r}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas must be in [0, 1), got {betas!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.comm, self.freeze_step = comm, freeze_step
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name
        self.error_feedback, self.grads_averaged = error_feedback, grads_averaged
        self.per_tensor = per_tensor
        self.allreduce = allreduce  # the compressed all-reduce used (lab 13 passes the student's)
        self._error_buffers = {}  # index of a compressed group -> (worker error, server error)
        self._device = None
        self.steps_done = 0

    @property
    def compressing(self) -> bool:
        """True once the next step is a compressed one (the warm-up is over)."""
        return self.steps_done >= self.freeze_step

    @torch.no_grad()
    def _average_gradients(self, params):
        """Warm-up: the fp32 average of the gradients, one all-reduce of them all (flat)."""
        if self.comm.size == 1 or self.grads_averaged or not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.comm.all_reduce(flat)
        flat.div_(self.comm.size)
        for p, part in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(part.view_as(p.grad))

    def _errors(self, key, numel):
        """(worker, server) error buffers for a momentum of `numel` elements, None without
        feedback."""
        if not self.error_feedback:
            return None, None
        if key not in self._error_buffers:
            n = padded_numel(numel, self.comm.size)
            self._error_buffers[key] = (
                torch.zeros(n, device=self._device),
                torch.zeros(n // self.comm.size, device=self._device),
            )
        return self._error_buffers[key]

    @torch.no_grad()
    def _all_reduce_momenta(self, momenta):
        """Every m <- the 1-bit average over ranks of every rank's m: one compressed_allreduce per
        tensor (DeepSpeed's grouping: a scale per tensor), or per_tensor=False one of them all,
        flat."""
        groups = [[m] for m in momenta] if self.per_tensor else [momenta]
        for group in groups:
            n = sum(m.numel() for m in group)
            flat = torch.zeros(padded_numel(n, self.comm.size), device=self._device)
            flat[:n] = torch.cat([m.reshape(-1).float() for m in group])
            out = self.allreduce(flat, self.comm, *self._errors(tuple(id(m) for m in group), n))
            for m, part in zip(group, out[:n].split([m.numel() for m in group])):
                m.copy_(part.view_as(m))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress = self.compressing
        live = [
            (p, group) for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        if not compress:
            self._average_gradients([p for p, _ in live])
        self.steps_done += 1
        for p, group in live:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            beta1, beta2 = group["betas"]
            # m = b1 m + (1 - b1) g, torch Adam's rounding
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            if not compress:
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad.conj(), value=1 - beta2)
                state["frozen_step"] = state["step"]  # v's age, for its bias correction once frozen
        if compress and self.comm.size > 1 and live:
            self._device = live[0][0].device
            self._all_reduce_momenta([self.state[p]["exp_avg"] for p, _ in live])
        for p, group in live:
            state = self.state[p]
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            if wd:
                p.mul_(1 - lr * wd)  # decoupled, as AdamW
            bc1, bc2_sqrt = 1.0, 1.0
            if group["bias_correction"]:
                bc1 = 1 - beta1 ** state["step"]
                frozen = state.get("frozen_step", 0)  # 0: no warm-up at all, v is still zeros
                bc2_sqrt = (1 - beta2 ** frozen) ** 0.5 if frozen else 1.0
            denom = (state["exp_avg_sq"].sqrt() / bc2_sqrt).add_(eps)
            p.addcdiv_(state["exp_avg"], denom, value=-lr / bc1)
        return loss

    def bytes_per_step(self, compressed: bool | None = None) -> float:
        """Bytes this rank sends in one step of the given phase (default: the next step's), by
        formula."""
        compressed = self.compressing if compressed is None else compressed
        params = [p for g in self.param_groups for p in g["params"]]
        world = self.comm.size
        if not compressed:
            return 0.0 if self.grads_averaged else bytes_allreduce(sum(p.numel() for p in params),
                                                                   world)
        if not self.per_tensor:
            return bytes_compressed(sum(p.numel() for p in params), world)
        return sum(bytes_compressed(p.numel(), world) for p in params)


def end_to_end_reduction(
    total_steps: int, freeze_step: int, warmup_bytes: float, compressed_bytes: float
) -> float:
    """How many times fewer bytes a run of total_steps sends with 1-bit Adam than with Adam all
    along: T B / (F B + (T - F) B_1), F = min(freeze_step, T). With B_1 = B/32 and F = 0.15 T this
    is 5.7x, the paper's "up to 5x": the warm-up, not the 32x of the compressed phase, sets it."""
    warm = min(freeze_step, total_steps)
    return (
        total_steps * warmup_bytes / (warm * warmup_bytes + (total_steps - warm) * compressed_bytes)
    )
