# Lab 03: Dynamic loss scaler for fp16 mixed precision
# GENERATED from minizero/precision.py by `make labs`. Edit nothing: this is the reference solution.
#   run:   mpirun -n 4 python solutions/lab03_loss_scaler.py
#   check: python -m minizero_course grade --lab 3 --impl solutions    (or: pytest -m lab3 --impl solutions)
"""Mixed precision: 16-bit compute, fp32 master weights, and DeepSpeed's dynamic loss scaler.

Micikevicius et al. 2018, "Mixed Precision Training" (ICLR), Sec. 3, three tricks:
  3.1 an fp32 **master copy** of the weights. An update lr*g is often smaller than half an fp16
      ulp of the weight it is added to (2^-11 relative), so w16 + u16 == w16: it is lost. The
      optimizer therefore steps fp32 masters, then rounds them into the 16-bit model.
  3.2 **loss scaling**. fp16 has 5 exponent bits: nothing below 2^-24 survives, and below 2^-14
      it loses precision. Small gradients vanish. Multiply the loss by S (chain rule: every
      gradient is multiplied by S), then divide the fp32 gradients by S before the step.
      Too big an S overflows (inf/nan): skip that step and lower S.
  3.3 fp32 accumulation for reductions (matmul sums, softmax, the loss): `fp32_loss` below.
bf16 has fp32's 8 exponent bits (same range, fewer mantissa bits), so no gradient underflows
or overflows that fp32 would not: bf16 needs master weights (3.1) but no loss scaler.

Bytes per parameter (ZeRO paper, Sec. 3.1): 2 (16-bit params) + 2 (16-bit grads) + 12 (fp32
master 4 + Adam m 4 + Adam v 4) = 16. `memory.measure(model, MixedPrecisionOptimizer)` finds
them in the real tensors; the fp32 copy of the gradients exists only inside step() and is
reported to memory.transient, the way DeepSpeed's stage-0 fp16 optimizer frees it after the step.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from minizero import comm as comm_mod
from minizero import memory

HALF = (torch.float16, torch.bfloat16)


class MinLossScaleError(FloatingPointError):
    """Gradients overflow even at min_loss_scale: training would only skip steps (or, without the
    check, apply inf/nan). DeepSpeed raises too ("Current loss scale already at minimum")."""


def _agreeing_comm(comm):
    """The ranks that must agree on overflow. None: the global communicator if this process is one
    of several ranks (we must not let ranks disagree), else nobody: a lone process needs no vote."""
    if comm is not None:
        return comm
    if comm_mod.is_initialized():
        return comm_mod.get()
    return comm_mod.get() if comm_mod.launched_world_size() > 1 else None


class LossScaler:
    """DeepSpeed's fp16 loss scaler, with the keys of DeepSpeed's "fp16" config section.

    loss_scale > 0 makes it static (that scale forever; overflowing steps are still skipped).
    loss_scale == 0 (the default) makes it dynamic, starting at 2**initial_scale_power. The rule,
    as in deepspeed/runtime/fp16/loss_scaler.py (DynamicLossScaler.update_scale):
      * overflow: while more than one unit of the hysteresis budget is left, spend one and keep the
        scale; with one left (or hysteresis=1) halve the scale, floored at min_loss_scale; if it is
        already there, raise MinLossScaleError. The budget is NOT refilled by halving: once spent,
        every further overflow halves again.
      * good step: with consecutive_hysteresis, refill the budget. With k good steps in a row
        since the last overflow (or since the start), the scale doubles, and the budget refills,
        when k - 1 is a positive multiple of loss_scale_window: DeepSpeed's off-by-one makes the
        first doubling come on the (window+1)-th good step, then every window steps.
    """

    def __init__(self, loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                 consecutive_hysteresis=False, min_loss_scale=1.0, raise_error_at_min_scale=True):
        if loss_scale < 0 or loss_scale_window < 1 or hysteresis < 1 or min_loss_scale <= 0:
            raise ValueError("need loss_scale >= 0, loss_scale_window >= 1, hysteresis >= 1, "
                             "min_loss_scale > 0")
        self.dynamic = loss_scale == 0
        self.cur_scale = float(2 ** initial_scale_power if self.dynamic else loss_scale)
        # DeepSpeed accepts it, then RAISES S on overflow
        if self.dynamic and self.cur_scale < min_loss_scale:
            raise ValueError(f"initial scale 2**{initial_scale_power} is below "
                             f"min_loss_scale={min_loss_scale:g}")
        self.loss_scale_window = loss_scale_window  # good steps between doublings
        self.hysteresis = hysteresis                # overflows tolerated before the scale halves
        self.min_loss_scale = min_loss_scale  # the floor; at it an overflow raises (or not, below)
        self.consecutive_hysteresis = consecutive_hysteresis  # refill the budget on every good step
        # False: stay at the floor and skip
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0             # update() calls so far
        self.last_overflow_iter = -1  # cur_iter of the last overflow (-1: none yet)
        # budget: an overflow spends one unit, or halves S when one is left
        self.cur_hysteresis = hysteresis

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S, in fp32 so that the scaled loss itself cannot overflow fp16."""
        return loss.float() * self.cur_scale

    @torch.no_grad()
    def unscale_and_check(self, grads, comm=None) -> bool:
        """True if any gradient of ANY rank is inf/nan; otherwise divide them by the scale in place.

        The vote is an all-reduce(max) of a 0/1 flag over `comm` (see _agreeing_comm), so every rank
        skips the same steps: with sharded gradients (ZeRO-2/3) a rank sees only its own shard, and
        ranks that disagreed would step different parameters, or wait in different collectives."""
        grads = [g for g in grads if g is not None]
        comm = _agreeing_comm(comm)
        # the vote lives where the communicator does (offloaded
        # gradients are on the host, NCCL's flag on the GPU)
        device = (
            comm.device if comm is not None else grads[0].device if grads else torch.device("cpu")
        )
        # decide `overflow`: True if any tensor in `grads` holds an inf or a nan on ANY rank.
        #   What must hold: every rank gets the same answer (with sharded gradients a rank sees only
        #   its shard: ranks that disagreed would step different parameters, or wait in different
        #   collectives), True if any element of any tensor in `grads`, on any rank, is inf or nan.
        #   Test the elements themselves (torch.isfinite): a sum or a norm of finite fp16 values can
        #   overflow on its own. The vote is ONE collective on a small tensor on `device` (where the
        #   communicator's buffers live); `comm` is None for a lone process, which votes alone.
        #   API: comm.all_reduce(tensor, op="sum", async_op=False), in place; op: "sum", "avg",
        #   "max", "min". Which op turns "some rank saw an overflow" into the same True everywhere?
        flag = torch.zeros(1, device=device)
        if any(not bool(torch.isfinite(g).all()) for g in grads):
            flag.fill_(1.0)
        if comm is not None:
            comm.all_reduce(flag, op="max")
        overflow = bool(flag.item())
        if not overflow and self.cur_scale != 1.0:
            for g in grads:
                g.mul_(1.0 / self.cur_scale)  # S is a power of two: exact unless g is subnormal
        return overflow

    def update(self, overflow: bool):
        """Adjust the scale after a step, DeepSpeed's rule (class docstring). Call once per step."""
        if not self.dynamic:
            self.cur_iter += 1
            return
        # update the scale by DeepSpeed's rule in the class docstring.
        #   What must hold: the scale follows DeepSpeed's DynamicLossScaler.update_scale over any
        #   sequence of overflows and good steps (the grader replays many against it), the
        #   hysteresis budget and DeepSpeed's off-by-one included, as the class docstring states
        #   them. The state is cur_scale, cur_hysteresis, last_overflow_iter (-1 before any
        #   overflow) and cur_iter (the number of update() calls so far, this one included once it
        #   returns); state_dict saves just these, so a resumed run goes on exactly as before. "k
        #   good steps in a row" counts from the update after the last overflow. An overflow at the
        #   floor raises MinLossScaleError when raise_error_at_min_scale, with a message that names
        #   min_loss_scale.
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_loss_scale and self.raise_error_at_min_scale:
                    raise MinLossScaleError(
                        f"fp16 gradients overflow even at min_loss_scale={self.min_loss_scale:g} (update "
                        f"{self.cur_iter}): the scale cannot go lower, and stepping would train on inf/nan. "
                        "Look for a diverging loss (lr too high?) or bad inputs, or train in bf16.")
                self.cur_scale = max(self.cur_scale / 2, self.min_loss_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.loss_scale_window == 0:
                self.cur_scale *= 2
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
        self.cur_iter += 1

    _STATE = ("dynamic", "cur_scale", "loss_scale_window", "hysteresis", "min_loss_scale",
              "consecutive_hysteresis", "raise_error_at_min_scale", "cur_iter",
              "last_overflow_iter", "cur_hysteresis")

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict):
        for k in self._STATE:
            setattr(self, k, state[k])


@torch.no_grad()
def clip_grad_norm_(grads, max_norm: float, shard_comm=None, *, replicated=(), weights=None,
                    replicated_weights=None, model_comms=()) -> torch.Tensor:
    """Scale `grads` in place so that their global L2 norm is at most max_norm; return the norm.

    Call it on UNSCALED gradients (after unscale_and_check), or max_norm would be compared with
    S times the norm. shard_comm: the ranks over which the gradients are sharded (ZeRO-2/3): each
    holds a different piece, so the squared norms are summed over them. None for replicated ones.
    The engine's clip (every parallelism at once) adds: `replicated`, gradients equal on every data-
    parallel rank (counted once); per-tensor `weights` (a number or one per element: 1/t for a
    tensor each tensor-parallel rank holds whole, 0 for a copy counted elsewhere); `model_comms`,
    the groups over which the replicated ones differ (pipeline stages, tensor-parallel slices).
    shard_comm then spans every rank holding a different piece (the world):
        ||g||^2 = sum over shard_comm of sum_sharded w g^2
                  +  sum over model_comms of sum_replicated w g^2"""
    tensors = [g for g in [*grads, *replicated] if g is not None]
    # the sums meet on the communicator's device: offloaded gradients are host tensors
    # (ZeRO-Offload), which a device collective refuses (NCCL), so each tensor's square sum is taken
    # where it lives and then moved
    device = next((c.device for c in (shard_comm, *model_comms) if c is not None),
                  tensors[0].device if tensors else torch.device("cpu"))

    def squares(tensors, ws, total):
        for g, w in zip(tensors, ws or [None] * len(tensors)):
            if g is not None:
                w = w.to(g.device) if torch.is_tensor(w) else w
                total += (g.float().pow(2) if w is None else w * g.float().pow(2)).sum().to(device)
        return total
    sq = squares(list(grads), weights, torch.zeros(1, dtype=torch.float32, device=device))
    if shard_comm is not None:
        shard_comm.all_reduce(sq, op="sum")
    if model_comms:
        whole = squares(list(replicated), replicated_weights, torch.zeros_like(sq))
        for comm in model_comms:
            comm.all_reduce(whole, op="sum")
        sq += whole
    else:
        squares(list(replicated), replicated_weights, sq)
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s epsilon
    for g in tensors:
        g.mul_(coef.to(g.device, g.dtype))
    return norm


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """fp32 master weights around any torch optimizer: step the masters, round them into the model.

        model = TinyGPT().to(torch.float16)
        opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.Adam, LossScaler(), lr=1e-3)
        opt.backward(loss); opt.step(); opt.zero_grad()

    loss_scaler: a LossScaler for fp16; None for bf16 (no scaling, no overflow check: a non-finite
    bf16 gradient is a real divergence, not a too-large scale). clip_grad: global-norm clipping of
    the unscaled fp32 gradients (0: off). comm: the ranks that vote on overflow (_agreeing_comm).
    After step(), `overflow` says whether the step was skipped; `skipped_steps` counts them.
    A torch.optim.Optimizer: param_groups are the groups of 16-bit parameters you passed (torch's LR
    schedulers edit them; their values reach the masters' optimizer at every step).
    """

    def __init__(self, params, optimizer_cls=torch.optim.Adam,
                 loss_scaler: LossScaler | None = None, clip_grad: float = 0.0, comm=None,
                 **optimizer_kwargs):
        groups = list(params)  # tensors, or torch's param groups (dicts with "params")
        groups = groups if groups and isinstance(groups[0], dict) else [{"params": groups}]
        seen, self.params, sizes = set(), [], []
        for group in groups:  # unique trainable ones, in order (a tied weight once)
            mine = [
                p
                for p in (
                    [group["params"]] if torch.is_tensor(group["params"]) else group["params"]
                )
                if p.requires_grad and id(p) not in seen and not seen.add(id(p))
            ]
            self.params += mine
            sizes.append(len(mine))
        bad = sorted({str(p.dtype) for p in self.params if p.dtype not in HALF})
        if bad:
            raise TypeError(f"MixedPrecisionOptimizer wants 16-bit parameters, got {bad}: convert "
                            "the model (model.to(torch.float16)); fp32 parameters need no master "
                            "copy, use the optimizer as is")
        # fresh fp32 storages: the 4 bytes of 4+4+4
        self.masters = [p.detach().float() for p in self.params]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.optimizer = optimizer_cls([{**g, "params": self.masters[a:a + n]}
                                        for g, a, n in zip(groups, starts, sizes)],
                                       **optimizer_kwargs)  # the optimizer of the fp32 masters
        super().__init__([{**g, "params": self.params[a:a + n]} for g, a,
                          n in zip(groups, starts, sizes)],
                         self.optimizer.defaults)
        self.loss_scaler = loss_scaler  # None: bf16 (no scaling needed); a LossScaler for fp16
        self.clip_grad = clip_grad      # max global gradient norm; 0: no clipping
        self.comm = comm                # the ranks that vote on overflow (None: this process alone)
        self.overflow = False           # the last step() found inf/nan and skipped
        self.skipped_steps = 0
        self.grad_norm = None           # the last step's global gradient norm (when clipping)

    def step_masters(self):
        """The masters' optimizer step, with the hyperparameters of param_groups (a scheduler's
        lr)."""
        # what torch's LR schedulers record in their wrapper of step(): the engine steps here
        self._opt_called = True
        for inner, outer in zip(self.optimizer.param_groups, self.param_groups):
            inner.update((k, v) for k, v in outer.items() if k != "params")
        self.optimizer.step()

    def backward(self, loss: torch.Tensor):
        (self.loss_scaler.scale(loss) if self.loss_scaler is not None else loss).backward()

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self):
        # fp32 copies of the 16-bit gradients, alive only
        # during the step (transient, not model state)
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        grads = [m.grad for m in self.masters if m.grad is not None]
        memory.transient.alloc("fp32 grads", sum(g.numel() * 4 for g in grads))
        try:
            self.overflow = False
            if self.loss_scaler is not None:
                self.overflow = self.loss_scaler.unscale_and_check(grads, self.comm)
                self.loss_scaler.update(self.overflow)
            # skip: masters, optimizer state and the 16-bit weights stay as they were
            if self.overflow:
                self.skipped_steps += 1
                self.zero_grad()
                return
            if self.clip_grad > 0:
                self.grad_norm = clip_grad_norm_(grads, self.clip_grad)
            self.step_masters()
            for p, m in zip(self.params, self.masters):
                p.copy_(m)  # round to nearest into the 16-bit weights the next forward uses
        finally:
            for m in self.masters:
                m.grad = None
            memory.transient.free("fp32 grads")

    def memory_tensors(self):
        """For memory.measure: the fp32 masters and the inner optimizer's state (m, v, step)."""
        for m in self.masters:
            yield "master_params", m, None
        for state in self.optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    yield "optimizer_state", v, None

    def state_dict(self) -> dict:
        return {
            "masters": [m.clone() for m in self.masters],
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "skipped_steps": self.skipped_steps,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        for p, m, saved in zip(self.params, self.masters, state["masters"]):
            m.copy_(saved)
            p.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
        # the saved lr, ...
        for inner, outer in zip(self.optimizer.param_groups, self.param_groups):
            outer.update((k, v) for k, v in inner.items() if k != "params")
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.skipped_steps = state["skipped_steps"]


def fp32_loss(model, x, y) -> torch.Tensor:
    """Cross-entropy from the model's (16-bit) logits, computed in fp32 (Micikevicius Sec. 3.3):
    a softmax and a mean over B*T tokens are reductions, and fp16's 11 bits would round them."""
    logits, _ = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(3, globals())
