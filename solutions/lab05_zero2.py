# Lab 05: ZeRO-2: gradients reduced into the shard during backward
# GENERATED from minizero/zero/shard_grad_op.py by `make labs`. Edit nothing: this is the reference solution.
#   run:   mpirun -n 4 python solutions/lab05_zero2.py
#   check: python -m minizero_course grade --lab 5 --impl solutions    (or: pytest -m lab5 --impl solutions)
"""ZeRO stage 2 (P_os+g): gradients sharded too, reduced into this rank's shard DURING backward.

Rajbhandari et al. 2020, "ZeRO", sec. 5.2. Per rank, with Ψ parameters, N ranks, K bytes of
optimizer state per parameter:

    ZeRO-1  2Ψ + 2Ψ + KΨ/N        ZeRO-2 (P_os+g)  2Ψ + (2+K)Ψ/N

A rank only ever steps its own 1/N, so it only needs the averaged gradient of that 1/N. So
instead of keeping full gradients until step() (ZeRO-1), every gradient is sent to its owner
as soon as autograd has produced it, and the full-size copy is freed at once. The paper:
"we bucketize all the gradients corresponding to a particular partition, and perform
reduction on the entire bucket at once ... a reduction instead of an all-reduce at the
partition boundaries". Communication is unchanged: the reductions add up to one reduce-
scatter of Ψ, the step's all-gather (ZeRO-1's, reused) another Ψ: 2(N-1)/N·Ψ, as DDP.

    model = ShardGradOp(TinyGPT(), torch.optim.Adam, bucket_numel=6_250_000, lr=1e-3)
    loss = model(x_shard, y_shard)[1]; loss.backward()   # gradients reduced during backward
    model.clip_grad_norm_(1.0); model.step(); model.zero_grad()

How, and why:
  * Same flat layout as ZeRO-1 (the step IS ZeRO-1's: ShardedOptimizer.step_shard). The flat
    gradient order is cut into buckets of about `bucket_numel` elements (DeepSpeed's
    reduce_bucket_size; the default 6.25M is 25 MB of fp32 gradients; bucket_cap_mb= takes torch's
    MiB), walking the
    parameters backwards (about the order backward produces them). A post-accumulate-grad
    hook copies p.grad into its bucket and sets p.grad = None: the full gradient lives only
    for the moment between autograd producing it and the copy.
  * A full bucket is reduced, asynchronously, to the ranks that own it: it is a contiguous
    range of the flat gradient, so it overlaps one or two shards (rarely more), and gets one
    `reduce` per owner (MPI's reduce_scatter wants N equal pieces; a bucket cut at arbitrary
    shard boundaries has unequal ones). DeepSpeed's stage 2 does the same (average_tensor).
    Over a step, the buckets tile [0, padded Ψ), so the reduces sum to one reduce-scatter.
  * Launch strictly in bucket order (every rank must issue the same collectives in the same
    order), and at most one bucket in flight: launching bucket k first waits for k-1 and frees
    it. So bucket memory peaks at about two buckets (one in flight, one filling), reported to
    memory.transient; without that cap, async reduces would keep all of Ψ alive.
  * The end of backward is found with an autograd callback queued by the first hook (as
    torch DDP does): it zero-fills the slots no hook filled (unused parameters: no hook fires,
    yet every rank must issue the same reduces), launches what is left and waits for all.
  * Param groups (params=...) with their own lr / weight_decay: ShardedOptimizer's runs; a
    parameter without a gradient is not decayed or moved (sharded_optimizer.py). Buffers: rank
    0's before every forward (broadcast_buffers, as torch DDP).
  * Frozen parameters are not in the flat buffer. A tied weight is one slot: its hook fires
    once, after autograd has summed both uses (a second firing in one backward is an error).
  * Gradient accumulation, two ways. Plain: several backwards before step(); each one reduces
    and ADDS into the shard gradient. Memory stays Ψ/N, but k micro-batches cost k reductions
    (DeepSpeed stage 2 does this too). no_sync(): backwards inside keep full gradients in
    p.grad (memory back to ZeRO-1's Ψ) and the next backward outside reduces the sum once
    (what FSDP's no_sync does). Scale each micro-batch loss by 1/k yourself.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.autograd.variable import Variable

from minizero import comm as comm_mod
from minizero import memory
from minizero.comm.bucket import Bucket, SyncSwitch, group_params
from minizero.comm.labels import labelled
from minizero.comm.stats import bucket_numel_from_mb
from minizero.zero.flat_shard_optimizer import check_optimizer_class, covering_param_groups
from minizero.zero.offload import HostGradShard
from minizero.zero.sharded_grad import is_placeholder, placeholder_grad
from minizero.zero.sharded_optimizer import ShardedOptimizer, clip_shard_grad_norm_


class Stage2Optimizer(ShardedOptimizer):
    """ShardGradOp's inner optimizer (model.optim): ZeRO-1's step on the gradient shard the wrapper
    reduced during backward. A user (or an LR scheduler) holding model.optim calls step() /
    zero_grad() on it and gets what model.step() / model.zero_grad() do: they are the same
    methods."""

    def __init__(self, owner, groups, optimizer_cls, comm, offload, optimizer_kwargs,
                 master_dtype=torch.float32):
        # the ShardGradOp whose grad_shard holds the gradients (weak: no cycle)
        self.owner = weakref.ref(owner)
        super().__init__(groups, optimizer_cls, comm, gradients_reduced=True, offload=offload,
                         master_dtype=master_dtype, **optimizer_kwargs)

    def reduce_gradients(self) -> torch.Tensor:
        owner = self.owner()
        owner._check_grad("step")
        return owner.grad_shard

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_gradient(self.gradient_for_step(self.reduce_gradients()))
        return loss

    def zero_grad(self, set_to_none: bool = True):
        owner = self.owner()
        owner._drop_placeholders()
        # the tier, had_grad, and full p.grad (only no_sync leaves them)
        super().zero_grad(set_to_none)
        owner.grad_shard.zero_()
        owner._has_grad = False


class ShardGradOp(SyncSwitch, nn.Module):
    """ZeRO-2 around `module`; `self.optim` is the ShardedOptimizer that steps this rank's shard."""

    def __init__(self, module: nn.Module, optimizer_cls, comm: comm_mod.Communicator | None = None,
                 bucket_numel: int = 6_250_000, overlap: bool = True, debug: bool | None = None,
                 params=None, broadcast_buffers: bool = True, offload=None,
                 bucket_cap_mb: float | None = None, master_dtype=torch.float32,
                 **optimizer_kwargs):
        """params: param groups of `module`'s parameters (nanoGPT's decay / no-decay pair), every
        trainable parameter in one of them; default: one group of module.parameters().
        offload: a zero.tiers.OffloadSpec: the shard's master and optimizer on the host
        (ZeRO-Offload). master_dtype: what the optimizer steps (ShardedOptimizer's; bf16:
        DeepSpeed's bf16_master_weights_and_grads)."""
        super().__init__()
        check_optimizer_class(optimizer_cls)
        if bucket_cap_mb is not None:  # torch's MiB, converted here once
            bucket_numel = bucket_numel_from_mb(bucket_cap_mb, module)
        if not bucket_numel or bucket_numel <= 0:
            raise ValueError(f"bucket_numel must be > 0, got {bucket_numel!r}")
        groups = covering_param_groups(module, module.parameters() if params is None else params,
                                       "ShardGradOp")
        self.module = module              # the wrapped model (torch's convention: .module)
        self.comm = comm or comm_mod.get()
        if (self.comm.debug if debug is None else debug) and self.comm.size > 1:
            self.comm.check_replicated(module.named_parameters(), "ShardGradOp")
        self.overlap = overlap            # reduce each bucket during backward (else all at its end)
        self.bucket_numel = bucket_numel  # gradients per bucket; a bigger parameter gets its own
        # rank 0's buffers before every forward (torch DDP's default)
        self.broadcast_buffers = broadcast_buffers
        # The sharded step of ZeRO-1, told that gradients arrive reduced (it allocates none).
        self.optim = Stage2Optimizer(self, groups, optimizer_cls, self.comm, offload,
                                     optimizer_kwargs, master_dtype)
        # frozen parameters and buffers: rank 0's (the flat buffer was broadcast by the optimizer)
        self.comm.broadcast_tensors([*(p for p in module.parameters() if not p.requires_grad),
                                     *module.buffers()])
        self.params = self.optim.params   # unique trainable parameters, in flat-buffer order
        self.layout = self.optim.layout   # where each parameter sits in the flat buffer
        # this rank's averaged gradient: the only gradient memory that outlives backward
        self.grad_shard = (
            torch.zeros(
                self.layout.shard_numel, dtype=self.optim.flat.dtype, device=self.optim.flat.device
            )
            if self.optim.tier is None
            else HostGradShard(self.optim.tier, self.optim.flat.dtype, self.optim.flat.device)
        )  # offloaded: the
        # host's fp32 buffer, each bucket's part copied down
        # into it during backward (ZeRO-Offload, Sec. 4.1)
        self.buckets = self._make_buckets(bucket_numel)
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.index}
        self._sync = True  # False inside no_sync(): keep full gradients, reduce later
        self._in_backward = False         # a backward's hooks have fired and its end is queued
        self._has_grad = False            # grad_shard holds reduced gradients not stepped yet
        self._next = 0                    # first bucket not launched yet in this backward
        self._in_flight = None            # the bucket launched last (at most one in flight)
        self.launched_in_hooks = 0  # buckets launched during backward (vs at its end): overlap
        for i, p in enumerate(self.params):
            # a backward without a forward through this wrapper (a pipeline's next micro-batch) must
            # not accumulate into the placeholder .grad: drop it before autograd's accumulation,
            # which follows this
            p.register_hook(lambda g, i=i: self._drop_placeholder(i))
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad_ready(i))

    def _make_buckets(self, bucket_numel: int) -> list[Bucket]:
        layout = self.layout
        groups = group_params(layout.numels, bucket_numel)
        # the first bucket (the last parameters) also covers the padding, so the buckets
        # tile the whole padded buffer and the reduces add up to a reduce-scatter of it
        return [Bucket(f"zero2.bucket{b}", [self.params[i] for i in group], group,
                       [layout.offsets[i] for i in group], layout.offsets[group[-1]],
                       layout.padded_numel if b == 0 else layout.offsets[group[0] + 1],
                       layout.shard_numel, self.comm.size) for b, group in enumerate(groups)]

    # ------------------------------------------------------------------ torch conventions
    def forward(self, *args, **kwargs):
        self._drop_placeholders()  # before autograd would accumulate into one
        # BatchNorm's statistics stay rank 0's
        if self.broadcast_buffers and torch.is_grad_enabled():
            self.comm.broadcast_tensors(list(self.module.buffers()))
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)  # no "module." prefix

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The module's weights (into the flat buffer). Optimizer shard:
        self.optim.load_state_dict."""
        out = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        # the fp32 master shard must follow, or the next step restores the old weights
        if self.optim.mixed:
            self.optim.master.copy_(self.optim.shard)
        return out

    # ------------------------------------------------------------------ backward
    def _on_grad_ready(self, i: int):
        """Runs right after autograd accumulated params[i]'s gradient into p.grad."""
        if not self._sync:
            return
        if not self._in_backward:  # first gradient of this backward: find its end
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self.buckets[self._bucket_of[i]]
        if bucket.filled[bucket.slot[i]]:
            raise RuntimeError(f"ShardGradOp: parameter {i} {tuple(self.params[i].shape)} got two "
                               "gradients in one backward")
        self.optim.had_grad[i] = True  # a local gradient: used (torch steps it)
        self._fill(bucket, i)
        while self.overlap and self._next < len(self.buckets) and self.buckets[self._next].full():
            self._launch(self.buckets[self._next])
            self.launched_in_hooks += 1

    def _fill(self, bucket: Bucket, i: int):
        """Copy params[i].grad (if any; else its slot stays zero) into the bucket, free it."""
        # copy parameter i's gradient into its bucket, then free it.
        #   What must hold: the bucket covers the range [bucket.lo, bucket.hi) of the flat (padded)
        #   gradient order, and params[i]'s gradient lands there flattened, at its own place
        #   (self.layout.offsets[i] is where it starts in the flat order, not in the buffer). The
        #   buffer lives only while its bucket is filled and reduced: the first fill of a backward
        #   creates it, zeroed (a parameter without a gradient, and the padding, send zeros), in
        #   self.grad_shard's dtype and on its device, and records it in the ledger under
        #   bucket.name (_complete frees it by that name). Once copied, the full gradient must go:
        #   ZeRO-2 keeps only its 1/N shard. The slot (bucket.slot[i] in bucket.filled) is marked
        #   filled with or without a gradient.
        #   API: memory.transient.alloc(name, tensor) records a live buffer;
        #   memory.transient.free(name) releases it.
        p = self.params[i]
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(bucket.hi - bucket.lo, dtype=self.grad_shard.dtype, device=self.grad_shard.device)  # noqa: E501 (lab text)
            memory.transient.alloc(bucket.name, bucket.buffer)
        if p.grad is not None:
            a = self.layout.offsets[i] - bucket.lo
            bucket.buffer[a:a + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = None
        bucket.filled[bucket.slot[i]] = True

    @labelled("mz.bucket.launch")  # a profiler range (comm/labels.py)
    def _launch(self, bucket: Bucket):
        """Reduce (sum) each part of the bucket to the rank that owns it, asynchronously."""
        if self._in_flight is not None:  # at most one in flight: bounded bucket memory
            self._complete(self._in_flight)
        # one async reduce per owner.
        #   What must hold: each part of the bucket is summed over the ranks onto the ONE rank that
        #   owns it: bucket.parts lists (owner, a, b), the range [a, b) of the flat order that lies
        #   in owner's shard (a bucket can straddle shards). a and b are flat positions; the buffer
        #   starts at bucket.lo. The reduces are asynchronous, their handles kept in bucket.works
        #   (_complete waits for them), so the rest of backward runs while they travel; every rank
        #   issues the same reduces in the same order.
        #   API: comm.reduce(tensor, dst=0, op="sum", async_op=False): only dst's tensor holds the
        #   result; with async_op=True it returns a handle with .wait().
        for owner, a, b in bucket.parts:
            part = bucket.buffer[a - bucket.lo:b - bucket.lo]
            bucket.works.append(self.comm.reduce(part, dst=owner, op="sum", async_op=True))
        self._in_flight = bucket
        self._next += 1

    @torch.no_grad()
    def _complete(self, bucket: Bucket):
        """Wait for the bucket's reduces; the owner ADDS the mean into its gradient shard."""
        # wait for every work in bucket.works, then keep this rank's part.
        #   What must hold: once every reduce of the bucket is done, the part this rank owns holds
        #   the SUM over the N ranks, and this rank's gradient shard must get the MEAN over the
        #   global batch, ADDED to what it holds (an earlier micro-batch, or another bucket of the
        #   same shard, may already be in it). self.grad_shard holds the flat positions [rank * S,
        #   (rank + 1) * S), S = self.layout.shard_numel; the other parts of the buffer hold nothing
        #   this rank needs.
        for work in bucket.works:
            work.wait()
        start = self.comm.rank * self.layout.shard_numel
        for owner, a, b in bucket.parts:
            if owner == self.comm.rank:
                part = bucket.buffer[a - bucket.lo:b - bucket.lo].div_(self.comm.size)
                self.grad_shard[a - start:b - start].add_(part)
        memory.transient.free(bucket.name)
        bucket.buffer, bucket.works = None, []
        if self._in_flight is bucket:
            self._in_flight = None

    @torch.no_grad()
    def _end_of_backward(self):
        """After the whole backward: reduce what is left, wait for everything."""
        for bucket in self.buckets[self._next:]:
            for s, i in enumerate(bucket.index):
                if not bucket.filled[s]:  # unused now (a no_sync grad in p.grad still counts)
                    self.optim.had_grad[i] |= self.params[i].grad is not None
                    self._fill(bucket, i)
            self._launch(bucket)
        if self._in_flight is not None:
            self._complete(self._in_flight)
        for bucket in self.buckets:
            bucket.reset()
        self._next, self._in_backward, self._has_grad = 0, False, True
        # torch's clip line on model.parameters() reaches grad_shard
        for i, p in enumerate(self.params):
            if p.grad is None:
                p.grad = placeholder_grad(p, self.comm, lambda i=i: self._shard_pieces(i),
                                          lambda f, div, i=i: self._scale_shard(i, f, div),
                                          lambda i=i: self.optim.full_grad(self._shard(), i),
                                          self._WHERE)

    _WHERE = ("ShardGradOp reduced it into this rank's shard of the averaged gradient "
              "(model.grad_shard) during backward")

    def _drop_placeholder(self, i: int):
        if is_placeholder(self.params[i].grad):
            self.params[i].grad = None

    def _drop_placeholders(self):
        for p in self.params:
            if is_placeholder(p.grad):
                p.grad = None

    def _shard(self) -> torch.Tensor:
        """This rank's averaged gradient shard, where the step reads it (offloaded: the host's
        buffer)."""
        self._check_grad("clip_grad_norm_")
        return (
            self.optim.gradient_for_step(self.grad_shard)
            if self.optim.tier is not None
            else self.grad_shard
        )

    def _shard_pieces(self, i: int) -> list:
        """The elements of params[i]'s averaged gradient this rank holds."""
        return self.optim._pieces_of(self._shard(), i)

    def _scale_shard(self, i: int, factor, divide: bool):
        for piece in self._shard_pieces(i):
            piece.div_(factor) if divide else piece.mul_(factor)

    # ------------------------------------------------------------------ step
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self._check_grad("clip_grad_norm_")
        return clip_shard_grad_norm_(
            self.comm,
            self.optim.gradient_for_step(self.grad_shard)
            if self.optim.tier
            # offloaded: on the host
            is not None
            else self.grad_shard,
            max_norm,
            norm_type,
        )

    def step(self, closure=None):
        # the same call as model.optim.step(): an LR scheduler on it counts it
        return self.optim.step(closure)

    def _check_grad(self, what):
        if self._in_backward:
            raise RuntimeError(f"ShardGradOp.{what}(): called during backward (from a hook?): the "
                               "gradient shard is complete only after loss.backward() returns")
        if not self._has_grad:
            raise RuntimeError(f"ShardGradOp.{what}(): no gradient yet: call loss.backward() first "
                               "(a backward inside no_sync() or with require_backward_grad_sync = "
                               "False only accumulates; the next one outside it reduces), and "
                               "zero_grad() after step(), not between them")

    def zero_grad(self, set_to_none: bool = True):
        self.optim.zero_grad(set_to_none)  # grad_shard and p.grad alike (Stage2Optimizer.zero_grad)

    @property
    def param_groups(self):
        return self.optim.param_groups

    # ------------------------------------------------------------------ memory
    def memory_tensors(self):
        """Full parameters, the gradient SHARD (plus any full p.grad: no_sync leaves them),
        and the sharded master copy and optimizer state. Buckets are transient."""
        for p in self.module.parameters():  # trainable ones are views of the flat buffer
            yield "parameters", p, None
            if p.grad is not None and not is_placeholder(p.grad):  # a placeholder holds no gradient
                yield "gradients", p.grad, None
        for b in self.module.buffers():
            yield "buffers", b, None
        if self.optim.tier is None:  # offloaded: the host buffer is the tier's to report
            yield "gradients", self.grad_shard, None
        yield from self.optim.memory_tensors()

    def extra_repr(self) -> str:
        sizes = [b.hi - b.lo for b in self.buckets]
        return f"world={self.comm.size}, overlap={self.overlap}, bucket_numels={sizes}"


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(5, globals())
