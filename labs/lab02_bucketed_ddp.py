# Lab 02: Bucketed DDP, overlapped with backward
# GENERATED from minizero/dp/ddp.py by `make labs`. Edit the TODO regions (everything else is the reference code).
#   run:   mpirun -n 4 python labs/lab02_bucketed_ddp.py
#   check: python -m minizero_course grade --lab 2 --impl labs    (or: pytest -m lab2 --impl labs)
"""minizero.dp.ddp: distributed data parallel, in three steps of sophistication.

Every rank holds the whole model and a 1/N slice of the global batch. After backward,
each rank has the gradient of ITS mean loss; all-reducing (sum) and dividing by N gives
the gradient of the mean over the global batch, so every rank takes the same optimizer
step and the replicas never drift apart (minizero_course/experiments/references.py has the proof).

    model = DDP(TinyGPT(), mode="overlap", bucket_numel=6_250_000)
    logits, loss = model(x_shard, y_shard)
    loss.backward()
    model.finish_gradient_synchronization()   # always, before optimizer.step()
    optimizer.step()

The three modes (lesson 02 times them against each other):
  "naive"    : after backward, one all-reduce per parameter. Many small messages, so the
               per-message latency (alpha in the alpha-beta model) dominates.
  "bucketed" : after backward, gradients are copied into a few flat buckets of about
               `bucket_numel` gradients each, and each bucket is all-reduced: few large
               messages, bandwidth bound. (The default, 6.25M fp32 gradients, is 25 MB; torch DDP's
               bucket_cap_mb=25 is 25 MiB = 6,553,600 fp32 gradients: pass bucket_cap_mb= to get
               torch's size. DeepSpeed's reduce_bucket_size counts elements, like bucket_numel.)
  "overlap"  : the same buckets, but a hook on each parameter fills its slot as soon as
               autograd has accumulated its gradient, and a bucket's all-reduce is launched
               (async) the moment it is full, while backward keeps computing earlier layers.
               This is torch's DistributedDataParallel (Li et al., VLDB 2020, sec. 3.2).
`mode=None` picks from the flags: bucket_numel=None -> naive, overlap -> overlap, else bucketed.

Decisions, and why:
  * finish_gradient_synchronization() is explicit (torch DDP hides it in an autograd
    callback). It makes the end of communication a visible line of the training loop,
    the place a timeline plot points at. Calling it twice for one backward is an error.
  * Buckets hold parameters in REVERSE registration order, about the order backward
    produces their gradients, and are launched strictly in bucket order on every rank:
    collectives must be issued in the same order everywhere or MPI mismatches them.
  * A parameter with no gradient on this rank (unused in this step) contributes zeros,
    so every rank still launches exactly the same collectives: no deadlock. At finish,
    a parameter that had no local gradient and whose averaged gradient is exactly zero
    was unused on every rank: it keeps grad None, as single-process training would
    (so Adam leaves its state alone). If another rank used it, it gets the average.
  * Tied weights are one Parameter object, reduced once (module.parameters() yields
    each object once). Frozen parameters (requires_grad=False) are never reduced.
  * After finish, each p.grad IS a view into its bucket (torch's gradient_as_bucket_view):
    the buckets are the gradient memory, held for the life of the wrapper, not a copy.
  * Buffers (BatchNorm's running statistics) are updated by each rank's forward from its own
    batch: rank 0's are broadcast before every forward under grad mode, as torch DDP's
    broadcast_buffers=True does ((N-1)/N of their bytes, counted), so they cannot drift apart.
    broadcast_buffers=False turns it off; a forward under no_grad (evaluation) never broadcasts.
  * One wrapper per model at a time. The parameter hooks hold the wrapper weakly, so a
    dropped wrapper goes quiet; two live wrappers of one model would both reduce.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from minizero import comm as comm_mod
from minizero.comm.bucket import Bucket, SyncSwitch, group_params
from minizero.comm.labels import labelled
from minizero.comm.stats import bucket_numel_from_mb

MODES = ("naive", "bucketed", "overlap")


class GradBucket(Bucket):
    """A bucket (comm/bucket.py) whose buffer, kept for the life of the wrapper, holds the
    gradients."""

    def fill(self, i: int):
        """Put params[i]'s local gradient (or zeros) into its slot and make p.grad that slot."""
        # TODO(lab 2): GradBucket.fill: copy parameter i's gradient into its slot.
        #   What must hold afterwards: the slot self.views[i] holds params[i]'s local gradient, or
        #   zeros if it got none (every rank all-reduces the whole buffer, and the buffer still
        #   holds the last step's average); self.had_grad[i] says whether there was one (finish
        #   tells "unused on every rank" from "a zero gradient" with it); self.filled[i] is set.
        #   p.grad must then BE the slot, not a copy: autograd's own gradient tensor is freed now,
        #   not at finish, and a later backward (no_sync) accumulates straight into the buffer. A
        #   p.grad that already is the slot (same storage: data_ptr()) holds the right values
        #   already.
        raise NotImplementedError('lab 2: not implemented yet: GradBucket.fill')


# Live wrappers with a backward not finished yet: an optimizer stepping one of their parameters now
# would step the local (or half-reduced, still in flight) gradient, silently. The step pre-hook
# below refuses it.
_PENDING = weakref.WeakSet()
_STEP_HOOK = []  # the handle of the global optimizer step pre-hook, registered by the first DDP


def _refuse_unfinished_step(optimizer, args, kwargs):
    for ddp in list(_PENDING):
        if any(
            id(p) in ddp._param_ids for group in optimizer.param_groups for p in group["params"]
        ):
            raise RuntimeError(
                "optimizer.step() before model.finish_gradient_synchronization(): the gradients "
                "are still this rank's own (or in flight). Call "
                "model.finish_gradient_synchronization() after the last backward and before step() "
                "(torch DDP does it inside backward; minizero makes it a visible line).")


def _hook(ddp_ref, i):
    def on_grad_ready(param):
        ddp = ddp_ref()
        if ddp is not None:
            ddp._on_grad_ready(i)
    return on_grad_ready


class DDP(SyncSwitch, nn.Module):
    def __init__(self, module: nn.Module, comm: comm_mod.Communicator | None = None,
                 bucket_numel: int | None = 6_250_000, overlap: bool = True,
                 mode: str | None = None, broadcast_buffers: bool = True,
                 bucket_cap_mb: float | None = None):
        """bucket_cap_mb: torch DDP's bucket size in MiB, as torch reads it (25 -> 25 * 2**20
        bytes); when given it sets bucket_numel from the parameters' element size (25 MiB =
        6,553,600 fp32 gradients)."""
        super().__init__()
        self.module = module
        self.comm = comm or comm_mod.get()
        if bucket_cap_mb is not None:
            bucket_numel = bucket_numel_from_mb(bucket_cap_mb, module)
        self.mode = mode or (
            "naive" if bucket_numel is None else "overlap" if overlap else "bucketed"
        )
        if self.mode not in MODES:
            raise ValueError(f"unknown DDP mode {self.mode!r}; use one of {MODES}")
        if self.mode != "naive" and not (bucket_numel and bucket_numel > 0):
            raise ValueError(f"mode {self.mode!r} needs bucket_numel > 0, got {bucket_numel!r}")
        self.bucket_numel = bucket_numel  # gradients per bucket (a bigger parameter gets its own)
        # rank 0's buffers before every forward, as torch DDP
        self.broadcast_buffers = broadcast_buffers
        self._broadcast_from_rank0()
        # Unique trainable parameters. parameters() yields a tied weight once.
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
        self.buckets = [] if self.mode == "naive" else self._make_buckets(bucket_numel)
        # _where[i] = (bucket index, slot) of self.params[i]; None in naive mode
        self._where = [None] * len(self.params)
        for b, bucket in enumerate(self.buckets):
            for s, i in enumerate(bucket.index):
                self._where[i] = (b, s)
        self._sync = True          # False inside no_sync()
        self._pending = False      # a synced backward happened and is not finished yet
        self._got_grad = [False] * len(self.params)
        # what an optimizer step must not touch while pending
        self._param_ids = {id(p) for p in self.params}
        if not _STEP_HOOK:
            _STEP_HOOK.append(register_optimizer_step_pre_hook(_refuse_unfinished_step))
        self._next = 0             # overlap: first bucket not launched yet
        # The hooks hold the wrapper weakly: a dropped DDP (re-wrapping the same model in a
        # notebook loop) must not keep launching all-reduces from its leftover hooks.
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(_hook(weakref.ref(self), i))

    # ------------------------------------------------------------------ construction
    def _broadcast_from_rank0(self):
        """Every rank starts from rank 0's weights and buffers, frozen ones too: ranks that
        built the model with different seeds would otherwise train different models."""
        self.comm.broadcast_tensors([*self.module.parameters(), *self.module.buffers()])

    def _make_buckets(self, bucket_numel: int) -> list[GradBucket]:
        groups = group_params([p.numel() for p in self.params], bucket_numel,
                              [p.dtype for p in self.params])
        buckets, lo = [], 0  # the flat order: the buckets' buffers one after the other
        for b, group in enumerate(groups):
            params = [self.params[i] for i in group]
            offsets = [lo + sum(p.numel() for p in params[:s]) for s in range(len(params))]
            hi = lo + sum(p.numel() for p in params)
            bucket = GradBucket(f"ddp.bucket{b}", params, group, offsets, lo, hi)
            bucket.allocate(params[0].dtype, self.comm.device)
            buckets.append(bucket)
            lo = hi
        return buckets

    # ------------------------------------------------------------------ torch conventions
    def forward(self, *args, **kwargs):
        # Buffers a forward changes (BatchNorm's running statistics, computed from each rank's own
        # batch) would drift apart: rank 0's win before every training forward, as in torch DDP
        # (broadcast_buffers=True). Not under no_grad: an
        # evaluation on one rank must not wait for the others.
        if self.broadcast_buffers and torch.is_grad_enabled():
            self.comm.broadcast_tensors(list(self.module.buffers()))
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)  # keys without a "module." prefix

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ on the module's parameters, once their gradients are
        averaged (equal on every rank, so every rank computes the same norm without
        communicating)."""
        if self._pending:
            raise RuntimeError("DDP.clip_grad_norm_(): call "
                               "model.finish_gradient_synchronization() first: the gradients are "
                               "not averaged over the ranks yet")
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type)

    # ------------------------------------------------------------------ backward
    def _on_grad_ready(self, i: int):
        """Runs right after autograd accumulated params[i]'s gradient into p.grad."""
        if not self._sync:
            return
        if self._got_grad[i]:
            raise RuntimeError(
                f"DDP: parameter {self._names[id(self.params[i])]!r} got a second gradient before "
                "finish_gradient_synchronization(). Call it after every backward(), or run all but "
                "the last micro-batch under no_sync().")
        self._got_grad[i] = self._pending = True
        _PENDING.add(self)
        if self.mode == "overlap":
            # TODO(lab 2): overlap: fill the slot, then launch every full bucket, in order.
            #   What must hold: a bucket is all-reduced (self._launch) as soon as it is full AND
            #   every bucket before it has been launched. Every rank must issue the same all-reduces
            #   in the same order, or MPI pairs up the wrong ones, while the ranks see their
            #   gradients in different orders (a parameter one rank did not use is filled only at
            #   finish). self._where[i] is params[i]'s (bucket index, slot); self._next is the first
            #   bucket not launched yet (_launch advances it); a bucket's .filled lists its slots.
            #   One gradient can complete several buckets at once.
            raise NotImplementedError('lab 2: not implemented yet: overlap')

    @labelled("mz.bucket.launch")  # a profiler range (comm/labels.py)
    def _launch(self, bucket: GradBucket):
        bucket.works.append(self.comm.all_reduce(bucket.buffer, op="sum", async_op=True))
        self._next += 1

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        """Reduce what backward left (all of it unless overlapping), wait for every
        all-reduce, divide by N and leave the averaged gradient in p.grad."""
        if not self._pending:
            raise RuntimeError(
                "DDP.finish_gradient_synchronization(): nothing to synchronize. It was already "
                "called for this backward, or no backward ran outside no_sync() since the last "
                "call. Call it exactly once per optimizer step, after the last backward.")
        n = self.comm.size
        if self.mode == "naive":
            for p in self.params:
                had_grad = p.grad is not None
                g = p.grad if had_grad else torch.zeros_like(p)
                if not g.is_contiguous():
                    g = p.grad = g.contiguous()
                self.comm.all_reduce(g, op="sum")  # blocking, one message per tensor
                g.div_(n)
                if not had_grad and g.any():  # someone else used it: take the average
                    p.grad = g
        else:
            # TODO(lab 2): finish: launch the rest, wait, average and unflatten.
            #   What must hold: every bucket is launched exactly once per backward, in bucket order
            #   (overlap launched self.buckets[:self._next] already; bucketed mode, none), with
            #   every slot filled: a slot never filled is a parameter without a local gradient, and
            #   it still goes, as zeros. After its all-reduce is done (bucket.works holds the
            #   handles; .wait()), each p.grad is its slot holding the MEAN over the n ranks (DDP
            #   averages, the all-reduce sums). A parameter with no local gradient whose average is
            #   all zeros was unused on every rank: its grad stays None (torch DDP's rule;
            #   optimizers skip it). bucket.reset() readies a bucket for the next backward.
            raise NotImplementedError('lab 2: not implemented yet: finish')
        self._pending, self._next = False, 0
        _PENDING.discard(self)
        self._got_grad = [False] * len(self.params)

    # ------------------------------------------------------------------ memory
    def memory_tensors(self):
        """For memory.measure: the module's tensors, plus the buckets as gradients. They are
        allocated once and kept, and after finish every p.grad is a view into them."""
        for p in self.module.parameters():
            yield "parameters", p, None
            if p.grad is not None:
                yield "gradients", p.grad, None
        for b in self.module.buffers():
            yield "buffers", b, None
        for bucket in self.buckets:
            yield "gradients", bucket.buffer, None

    def extra_repr(self) -> str:
        sizes = [b.buffer.numel() for b in self.buckets]
        return f"mode={self.mode!r}, world={self.comm.size}, bucket_numels={sizes}"


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(2, globals())
