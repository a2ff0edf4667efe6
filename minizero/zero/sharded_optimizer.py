"""ZeRO stage 1 (P_os): every rank keeps the optimizer state of 1/N of the parameters only.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", sec. 5.1 and Fig. 1. Per rank, with Ψ parameters, N ranks and K bytes of optimizer
state per parameter (K = 12 for mixed-precision Adam: fp32 master, momentum, variance):

    DDP    2Ψ + 2Ψ + KΨ          ZeRO-1 (P_os)    2Ψ + 2Ψ + KΨ/N     (eq. in sec. 5.1)

Communication stays that of DDP (sec. 7.2.1): instead of all-reducing the gradients, reduce-
scatter them (each rank receives the average of only the 1/N it owns), step that 1/N, and
all-gather the updated parameters: (N-1)/N·Ψ + (N-1)/N·Ψ = 2(N-1)/N·Ψ elements, the ring all-
reduce's volume. minizero.comm counts exactly this (see tests/test_zero12.py).

    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)   # or param groups:
    opt = ShardedOptimizer([{"params": decay, "weight_decay": 0.1},
                            {"params": no_decay, "weight_decay": 0.0}],
                           torch.optim.AdamW, lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 100)  # a torch.optim.Optimizer: schedulers take it
    loss = model(x_shard, y_shard)[1]; loss.backward()
    opt.clip_grad_norm_(1.0)         # optional: the GLOBAL norm, across shards
    # module=model: its buffers (BatchNorm statistics) stay rank 0's, as under torch DDP
    opt.step(); opt.zero_grad()

Layout (minizero.zero.flat_layout.FlatLayout): the trainable parameters (a tied weight once, frozen
ones not at all) become views into ONE flat buffer padded to a multiple of N; rank r owns
[r·S, (r+1)·S), S = ceil(Ψ/N), cut wherever it falls, even through a tensor. That is fine
because the optimizers we wrap are ELEMENTWISE: SGD, Adam, AdamW, ... update each element
from its own gradient and state, so stepping a slice of the flat buffer as one big tensor is
the same arithmetic as stepping the parameters one by one. Optimizers that look across a
tensor are refused (LBFGS, Adafactor's row/column factors, Muon's orthogonalization,
SparseAdam) and per-tensor trust ratios (LAMB, LARS) would silently change: don't wrap them.

Decisions, and why:
  * fp32 parameters: the inner optimizer steps the flat buffer's own shard (a view), no
    master copy, because it would be a byte-for-byte duplicate. fp16/bf16 parameters: an
    fp32 master shard (4·Ψ/N bytes, the ledger's "master_params") is stepped and cast back.
  * Gradients: a post-accumulate-grad hook moves each p.grad into its slot of a flat gradient
    buffer and makes p.grad that slot (as DDP's gradient_as_bucket_view), so gradient
    accumulation is plain autograd adding in place, and the flat buffer is the gradient
    memory: ZeRO-1 keeps full gradients, 4Ψ fp32 bytes (ZeRO-2 is what shards them). After
    step() p.grad holds this rank's LOCAL gradient; the average exists only as the shard.
  * gradients_reduced=True: the gradients were already averaged (e.g. by minizero.dp.ddp.DDP);
    step() just slices its shard out of p.grad. Comm is then all-reduce + all-gather.
  * A torch.optim.Optimizer (flat_shard_optimizer.py): param groups with their own lr /
    weight_decay (nanoGPT's decay / no-decay pair), torch's LR schedulers, state_dict(). The
    flat buffer lays the groups out one after another: ONE buffer, one reduce-scatter and one
    all-gather per step whatever the number of groups, and one padding; the inner optimizer
    steps each group's run of this rank's shard.
  * A parameter without a gradient (unused in this step on every rank) is left alone, as torch
    does: no weight decay, no momentum. "Unused" = no local gradient on this rank AND an exactly
    zero averaged gradient in this rank's piece (DDP's rule). The flat step is masked for it
    (flat_shard_optimizer.py says how, and the one difference left: Adam's step counter is one
    per run, so a parameter skipped in earlier steps gets that run's bias correction).
    DeepSpeed instead steps it with a zero gradient (weight decay shrinks it, momentum moves it).
  * fp16 loss scaling is the caller's: reduce_gradients() is the averaged shard, unscale and
    check it (minizero.precision), then step(), or zero_grad() to skip the step.
  * offload=OffloadSpec(...) (zero/tiers.py; ZeRO-Offload): the fp32 master and the optimizer live
    on the host and the step runs there; gradient_for_step() moves the averaged shard down,
    step_gradient() steps and brings the parameters up, then the all-gather runs as without offload.
"""
from __future__ import annotations

import torch

from minizero import comm as comm_mod
from minizero import memory, precision
from minizero.zero.consolidate import consolidate, load_consolidated
from minizero.zero.flat_layout import FlatLayout
from minizero.zero.flat_shard_optimizer import FlatShardOptimizer
from minizero.zero.offload import HostGradShard
from minizero.zero.sharded_grad import sharded_grad
from minizero.zero.tiers import build_tier


@torch.no_grad()
def clip_shard_grad_norm_(comm, grad_shard: torch.Tensor, max_norm: float, norm_type: float = 2.0):
    """Clip by the GLOBAL gradient norm when each rank holds one shard of the gradient.

    ||g||_2 = sqrt(sum over ranks of ||shard||_2^2): one all-reduce of ONE number (padding is
    zero and adds nothing). Clipping each shard by its own norm would be wrong: ranks would
    scale by different factors. Same coefficient as torch.nn.utils.clip_grad_norm_:
    max_norm / (norm + 1e-6), capped at 1. Returns the total norm (fp32, every rank)."""
    if norm_type == 2.0:  # the shard is this rank's piece: squares summed over the ranks
        return precision.clip_grad_norm_([grad_shard], max_norm, shard_comm=comm)[0]
    if norm_type != float("inf"):
        raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type}")
    total = (grad_shard.float().abs().max().reshape(1) if grad_shard.numel()
             else torch.zeros(1, device=grad_shard.device))
    comm.all_reduce(total, op="max")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    grad_shard.mul_(coef.to(grad_shard.dtype))
    return total[0]


class ShardedOptimizer(FlatShardOptimizer):
    """ZeRO-1: `optimizer_cls` on this rank's 1/N of the flat parameters, one run per param
    group."""

    def __init__(self, params, optimizer_cls, comm: comm_mod.Communicator | None = None,
                 gradients_reduced: bool = False, debug: bool | None = None, offload=None,
                 module=None, master_dtype=torch.float32, **optimizer_kwargs):
        """module: the model these parameters belong to, when no wrapper (DDP) keeps its buffers
        equal: then BatchNorm's running statistics are rank 0's at construction and after every step
        (torch DDP's broadcast_buffers, (N-1)/N of their bytes per step); without it each rank keeps
        its own. master_dtype: the dtype the optimizer steps. fp32 (default): 16-bit parameters get
        an fp32 master shard. The parameters' own dtype (DeepSpeed's bf16_master_weights_and_grads):
        the shard itself is stepped, with its gradient in that dtype, and the inner optimizer's
        state follows it (torch's Adam makes its moments like the tensor it steps: DeepSpeed's
        bf16_optimizer_states). DeepSpeed keeps a bf16 master copy of the bf16 shard; here the shard
        is the master (the same values: no duplicate), as in the fp32 case."""
        # groups and values checked: nothing changed yet
        super().__init__(params, optimizer_cls, optimizer_kwargs)
        self.comm = comm or comm_mod.get()
        # kept equal across ranks by step()
        self.buffers = [] if module is None else list(module.buffers())
        self.comm.broadcast_tensors(self.buffers)
        dtypes = {(p.dtype, p.device) for p in self.params}
        if len(dtypes) > 1:
            raise ValueError("one flat buffer holds one dtype on one device; got "
                             f"{sorted(map(str, dtypes))}")
        if (self.comm.debug if debug is None else debug) and self.comm.size > 1:
            # rank 0's values win below; debug says so loudly instead of training rank 0's model
            self.comm.check_replicated([(f"params[{i}]", p) for i, p in enumerate(self.params)],
                                       "ShardedOptimizer")
        self.gradients_reduced = gradients_reduced
        self.layout = FlatLayout([p.shape for p in self.params], self.comm.size)
        # The full flat parameter buffer: every rank holds all of it (ZeRO-1 shards only the
        # optimizer). Rank 0's values win, so every replica starts identical.
        self.flat = self.layout.flatten(self.params)
        self.comm.broadcast(self.flat, src=0)
        for p, view in zip(self.params, self.layout.views(self.flat)):
            p.data = view  # the model's parameters now live in self.flat
        self.shard = self.layout.shard(self.flat, self.comm.rank)
        if master_dtype not in (torch.float32, self.flat.dtype):
            raise ValueError("master_dtype must be torch.float32 or the parameters' "
                             f"{self.flat.dtype}, got {master_dtype}")
        if master_dtype != torch.float32 and offload is not None:
            raise ValueError("a 16-bit master_dtype with offload is not implemented: the host tier "
                             "keeps fp32 masters")
        self.master_dtype = master_dtype
        self.mixed = self.flat.dtype != master_dtype  # a separate master shard of another dtype
        # offload: the host tier (zero/tiers.py) holds the
        # fp32 master and steps it; else the device does
        self.tier = None if offload is None else build_tier(offload, [self.shard], optimizer_cls,
                                                            self.comm.rank,
                                                            after_params=self._all_gather_shard,
                                                            **optimizer_kwargs)
        if self.tier is not None:
            self.master = self.tier.masters[0]
        else:
            # same dtype: no redundant copy
            self.master = self.shard.float() if self.mixed else self.shard
        rank, shard_numel = self.comm.rank, self.layout.shard_numel
        data_end = min(shard_numel, max(0, self.layout.numel - rank * shard_numel))  # then padding
        self._build_runs(
            [
                (
                    self.master,
                    [(pc.index, pc.lo, pc.hi, pc.shard_lo) for pc in self.layout.pieces(rank)],
                    data_end,
                    False,
                )
            ],
            self.tier,
        )
        # this rank produced params[i].grad since zero_grad
        self.had_grad = [False] * len(self.params)
        self.flat_grad, self._grad_shard = None, None
        self._consolidated = None  # (rank it went to, the whole state there) since the last step
        if not gradients_reduced:
            self.flat_grad = torch.zeros_like(self.flat)
            # p.grad is this rank's unreduced gradient; as a ShardedGrad its norm (torch's clip
            # line) is the averaged gradient's and its mul_ scales the reduced shard too
            # (sharded_grad.py)
            self.grad_views = [sharded_grad(v, self.comm, lambda i=i: self.averaged_pieces(i),
                                            lambda f, div, i=i: self._scale_reduced(i, f, div),
                                            lambda i=i: self.full_grad(self.reduce_gradients(), i))
                               for i, v in enumerate(self.layout.views(self.flat_grad))]
            self._hooks = [p.register_post_accumulate_grad_hook(lambda p,
                                                                i=i: self._into_flat_grad(i))
                           for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------ gradients
    def _into_flat_grad(self, i: int):
        """Move params[i].grad into its slot of the flat gradient; p.grad becomes the slot, so
        the next backward (accumulation) adds into it in place."""
        p, slot = self.params[i], self.grad_views[i]
        if p.grad is None:
            slot.zero_()  # unused this step: contributes zeros (the same collectives everywhere)
            return
        self.had_grad[i] = True
        if p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
            p.grad = slot  # autograd's own tensor is freed now

    @property
    def grad_shard(self) -> torch.Tensor | None:
        """This rank's reduced gradient shard since the last zero_grad (None before the
        reduce-scatter)."""
        return self._grad_shard

    @torch.no_grad()
    def reduce_gradients(self) -> torch.Tensor:
        """This rank's shard of the AVERAGED gradient (computed once per step; step() and
        clip_grad_norm_() call it). Reduce-scatter of the flat gradient: (N-1)/N·Ψ·b sent."""
        if self._grad_shard is not None:
            return self._grad_shard
        if all(p.grad is None for p in self.params):
            raise RuntimeError("ShardedOptimizer.step(): no parameter has a gradient. Call "
                               "loss.backward() before step() (and zero_grad() after it, not "
                               "before it).")
        shard = torch.zeros(self.layout.shard_numel, dtype=self.flat.dtype, device=self.flat.device)
        memory.transient.alloc("zero1.grad_shard", shard)
        if self.gradients_reduced:  # already averaged: copy out only the pieces this rank owns
            self.had_grad = [h or p.grad is not None for h, p in zip(self.had_grad, self.params)]
            for pc in self.layout.pieces(self.comm.rank):
                g = self.params[pc.index].grad
                if g is not None:
                    shard[pc.shard_lo:pc.shard_lo + pc.hi - pc.lo] = g.reshape(-1)[pc.lo:pc.hi]
        else:
            for i in range(len(self.params)):
                self._into_flat_grad(i)  # a no-op for grads the hooks already moved
            self.comm.reduce_scatter(shard, self.flat_grad, op="sum")
            shard.div_(self.comm.size)  # sum / N = the mean over the global batch, as DDP
        self._grad_shard = shard
        return shard

    def _pieces_of(self, shard: torch.Tensor, i: int) -> list:
        return [
            shard[pc.shard_lo : pc.shard_lo + pc.hi - pc.lo]
            for pc in self.layout.pieces(self.comm.rank)
            if pc.index == i
        ]

    def averaged_pieces(self, i: int) -> list:
        """The elements of params[i]'s averaged gradient this rank holds (reduces first: a
        collective)."""
        return self._pieces_of(self.reduce_gradients(), i)

    @torch.no_grad()
    def full_grad(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """params[i]'s whole averaged gradient from every rank's gradient shard (an all-gather of
        the shards)."""
        full = torch.empty(self.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(full, shard.contiguous())
        a = self.layout.offsets[i]
        return full[a:a + self.layout.numels[i]].view(self.params[i].shape).clone()

    def _scale_reduced(self, i: int, factor, divide: bool):
        """p.grad.mul_ after the reduce: the reduced shard the step uses follows (before it, the
        reduce does)."""
        if self._grad_shard is not None:
            for piece in self._pieces_of(self._grad_shard, i):
                piece.div_(factor) if divide else piece.mul_(factor)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global-norm clipping over all shards (call after backward, before step)."""
        return clip_shard_grad_norm_(self.comm, self.reduce_gradients(), max_norm, norm_type)

    # ------------------------------------------------------------------ step
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_shard = self.reduce_gradients()
        self._consolidated = None
        if self.tier is None:
            self.step_shard(grad_shard)
        else:
            self.step_gradient(self.gradient_for_step(grad_shard))
        self._grad_shard = None
        memory.transient.free("zero1.grad_shard")
        # module= given: BatchNorm statistics stay rank 0's
        self.comm.broadcast_tensors(self.buffers)
        return loss

    @torch.no_grad()
    def gradient_for_step(self, grad_shard: torch.Tensor) -> torch.Tensor:
        """The fp32 gradient the step will use, where it will use it (unscale and clip it in place):
        the device shard (a copy when 16-bit), or, offloaded, the tier's host buffer (moved down,
        counted)."""
        if self.tier is None:
            return grad_shard.to(self.master_dtype)
        # ZeRO-2: backward already added each bucket's part into it
        if isinstance(grad_shard, HostGradShard):
            return grad_shard.host
        self.tier.grads_to_host([grad_shard])
        return self.tier.grads[0]

    @torch.no_grad()
    def step_gradient(self, grad: torch.Tensor):
        """Step with gradient_for_step()'s gradient: on the device (step_shard), or on the host
        tier, which steps (in a thread under DPU), copies the parameters up and all-gathers them."""
        self._consolidated = None
        # what torch's LR schedulers record in their wrapper of step(): the engine steps here
        self._opt_called = True
        if self.tier is None:
            self.step_shard(grad)
        else:
            self.tier.step()

    @torch.no_grad()
    def _all_gather_shard(self):
        """After the host tier wrote this rank's shard of the parameters: every rank gets all of
        them."""
        send = self.shard.clone()  # MPI may not send from inside the buffer it receives into
        self.comm.all_gather(self.flat, send)

    def used(self, grad_shard: torch.Tensor) -> set:
        """Parameters (indices) with a piece in this shard that got a gradient in this step: a local
        one (had_grad), or a nonzero average, so some other rank used it (DDP's rule)."""
        return {
            pc.index
            for pc in self.layout.pieces(self.comm.rank)
            if self.had_grad[pc.index]
            or bool(grad_shard[pc.shard_lo : pc.shard_lo + pc.hi - pc.lo].any())
        }

    @torch.no_grad()
    def step_shard(self, grad_shard: torch.Tensor):
        """Step this rank's 1/N with the averaged gradient of that 1/N, then all-gather the
        updated shards so every rank holds the full parameters for the next forward.
        ZeRO-2 calls this too, with the gradient shard it reduced during backward."""
        used = self.used(grad_shard)
        # mixed precision: the fp32 copy of the gradient shard lives only during the step
        with memory.transient.hold("zero1.fp32_grad_shard",
                                   grad_shard.numel() * 4 if self.mixed else 0):
            # BEGIN SOLUTION: step the shard.
            #   What must hold: self.step_masters(used) runs the inner torch optimizer on this
            #   rank's shard (self.master) and leaves the parameters outside `used` alone; like any
            #   torch optimizer it reads the gradient from .grad, which must have the master's dtype
            #   and shape (fp32 under mixed precision: torch refuses a 16-bit .grad on an fp32
            #   tensor). `grad_shard` is this rank's averaged 1/N of the gradient. After the step no
            #   gradient stays attached to the master: the fp32 copy lives only during the step (the
            #   ledger above counts it only there).
            self.master.grad = grad_shard.to(self.master.dtype)  # no copy when both are fp32
            self.step_masters(used)
            self.master.grad = None
            # END SOLUTION
        # BEGIN SOLUTION: all-gather the updated parameters into self.flat.
        #   What must hold: every rank ends with all N updated shards in self.flat (the model's
        #   parameters are views of it), in self.flat's dtype: 16-bit under mixed precision, while
        #   self.master is fp32. Each rank contributes its own stepped shard. self.shard is a view
        #   INTO self.flat, and MPI may not send from inside the buffer it receives into ("Buffers
        #   must not be aliased"): what is sent must be a tensor of its own, reported to the ledger
        #   while it lives (memory.transient.hold(name, tensor) is a context manager that does so).
        #   API: comm.all_gather(output, input, async_op=False): output holds comm.size x input's
        #   elements, rank r's input at the r-th place.
        send = self.master.to(self.flat.dtype, copy=True)
        with memory.transient.hold("zero1.all_gather_send", send):
            self.comm.all_gather(self.flat, send)
        # END SOLUTION

    def zero_grad(self, set_to_none: bool = True):
        if self.tier is not None:
            self.tier.zero_grad()
        self.had_grad = [False] * len(self.params)
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        if self._grad_shard is not None:  # reduced (e.g. by clip_grad_norm_) but never stepped
            self._grad_shard = None
            memory.transient.free("zero1.grad_shard")

    # ------------------------------------------------------------------ torch conventions
    def local_state_dict(self) -> dict:
        """This rank's shard only, in torch's format (flat_shard_optimizer.py); loads back on the
        same layout. fp32: the master IS the model's parameters, so it is not saved."""
        sd = super().local_state_dict()
        if self.mixed:
            sd["master"] = self.master.clone()
        return sd

    def state_dict(self) -> dict:
        """The WHOLE optimizer state, on the rank consolidate_state_dict(to=) sent it to (torch's
        ZeroRedundancyOptimizer convention); anywhere else, or before it, an error: this rank holds
        1/N."""
        if self._consolidated is None or self._consolidated[0] != self.comm.rank:
            where = "" if self._consolidated is None else \
                (f" (the last one consolidated to rank {self._consolidated[0]}, this is rank "
                 f"{self.comm.rank})")
            raise RuntimeError(f"{type(self).__name__}.state_dict(): this rank holds "
                               f"1/{self.comm.size} of the optimizer state{where}. Call "
                               "optimizer.consolidate_state_dict(to=0) on every rank after the "
                               "last step (as torch's ZeroRedundancyOptimizer), then state_dict() "
                               "on rank 0; optimizer.local_state_dict() is this rank's shard")
        return self._consolidated[1]

    def consolidate_state_dict(self, to: int = 0):
        """A collective: rank `to` gets the whole state in torch's per-parameter format
        (zero/consolidate.py) for state_dict(); valid until the next step."""
        if self.tier is not None:
            raise ValueError(f"{type(self).__name__}.consolidate_state_dict: the optimizer state "
                             "is offloaded; save it with the engine's save_checkpoint (it "
                             "reshards), or local_state_dict() per rank")
        if not 0 <= to < self.comm.size:
            raise ValueError(f"consolidate_state_dict(to={to}): to must be a rank in [0, "
                             f"{self.comm.size})")
        self._consolidated = (to, consolidate(self, to))

    def load_state_dict(self, state_dict: dict):
        """This rank's local_state_dict(), or a consolidated state_dict() (every rank takes its
        shard of it)."""
        if state_dict.get("consolidated"):
            load_consolidated(self, state_dict)
            return
        super().load_state_dict(state_dict)
        if self.mixed:
            with torch.no_grad():
                self.master.copy_(state_dict["master"])

    def memory_tensors(self):
        """For memory.measure: the full flat parameters, the full flat gradients (ZeRO-1 keeps
        them), and only shard-sized master copy and optimizer state."""
        yield "parameters", self.flat, None
        if self.flat_grad is not None:
            yield "gradients", self.flat_grad, None
        if self.mixed:
            yield "master_params", self.master, None
        if self.master.grad is not None:  # a gradient kept past step(): Ψ/N more bytes, really held
            yield "gradients", self.master.grad, None
        yield from self.optimizer_state_tensors()

    def __repr__(self):
        layout = self.layout
        return (f"ShardedOptimizer({type(self.optim).__name__}, rank "
                f"{self.comm.rank}/{self.comm.size}, psi={layout.numel}, "
                f"padded={layout.padded_numel}, shard={layout.shard_numel}, mixed={self.mixed})")
