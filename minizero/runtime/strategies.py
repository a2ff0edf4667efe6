"""The data-parallel strategies, one protocol to the engine: a wrapped module plus a torch
optimizer.

DDP, ZeRO-1, ZeRO-2, ZeRO-3 (FSDP, ZeRO++ which is FSDP with other collectives, and hybrid sharding
which is FSDP inside a node) differ in what a rank holds (Rajbhandari et al. 2020, Fig. 1: 16Ψ, 4Ψ +
12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N bytes for mixed-precision Adam) and where the gradient is reduced.
`Strategy` below declares everything the engines and the checkpoints use of one
(tests/test_strategy_protocol.py fails when the runtime reads a name it does not declare);
runtime/chain.select_strategy is the one place a plan becomes a strategy. docs/design.md, "How to
add a strategy", walks through HybridShardStrategy.

Offload is part of a strategy's spec (`spec.offload`, a zero.tiers.OffloadSpec): ShardedOptimizer /
ShardGradOp / FSDPOptimizer build their tier (zero/offload.py's HostOptimizer, zero/infinity.py's
DiskOptimizer), which then owns the fp32 masters, the gradients it steps and the step; the protocol
is unchanged.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from typing import Callable, NamedTuple

import torch

class SegmentPiece(NamedTuple):
    """Elements [lo, hi) of the flattened parameter `name` are tensor[offset:offset + hi - lo]."""
    name: str
    lo: int
    hi: int
    offset: int
    stepped: bool  # False: never had a gradient yet, so torch keeps no optimizer state for it


class Segment(NamedTuple):
    """One fp32 tensor an optimizer steps, and what it holds."""
    tensor: torch.Tensor
    optimizer: object       # whose .state[tensor] is its state
    pieces: list            # [SegmentPiece]
    replicated: bool        # the same on every data-parallel rank (written once)


class _Held(NamedTuple):
    """A buffer a strategy holds outside its module and optimizer, for the ledger
    (memory.measure)."""
    category: str
    tensor: torch.Tensor

    def memory_tensors(self):
        yield self.category, self.tensor, None


class Grads(NamedTuple):
    """The averaged fp32 gradients a rank holds for the step: `sharded` ones are this rank's piece
    (their squares add up over the data-parallel ranks), `replicated` ones are equal on every
    rank."""
    sharded: list
    replicated: list


class StrategySpec(NamedTuple):
    """What a strategy is built from: runtime/chain.strategy_spec reads it off the resolved
    EnginePlan."""
    optimizer_cls: type
    optimizer_kwargs: dict
    groups: list | None          # param groups (None: one group of every trainable parameter)
    dtype: torch.dtype           # the model's training dtype
    bucket_numel: int            # gradients per DDP / ZeRO-2 bucket (elements)
    overlap: bool                # reduce during backward (DDP, ZeRO-2)
    prefetch: bool               # ZeRO-3: gather the next unit while this one computes
    persistence_threshold: int   # ZeRO-3: parameters below this many elements stay whole
    zeropp: object               # ZeRO-3: a zero.tiers.ZeroPPSpec, or None
    node_mesh: object            # ZeRO++'s and hybrid sharding's nodes (a comm.Mesh), or None
    zero_init: object            # the zero.Init recorder the model was built under, or None
    offload: object  # a zero.tiers.OffloadSpec (the optimizer's tier, ZeRO-3's shards) or None
    # a pipeline runtime calls DDP's finish_gradient_synchronization itself
    runtime_syncs: bool = False
    shard_layout: str = "flat"   # ZeRO-3: "flat" units or "per_param" (FSDP2's dim-0 pieces)
    # ZeRO 1-2's master shard (bf16: bf16_master_weights_and_grads)
    master_dtype: torch.dtype = torch.float32

    @property
    def mixed_precision(self) -> bool:
        """fp16 or bf16 parameters with fp32 masters (precision.py)."""
        return self.dtype != torch.float32


class Strategy(ABC):
    """The protocol every data-parallel strategy implements; the engines and checkpoints use nothing
    else.

    Attributes (set by __init__):
        model       the module this rank trains (a pipeline stage, a TP split: what this rank has)
        comm        the data-parallel ranks it reduces and shards over
        spec        the StrategySpec it was built from
        wrapped     what forward calls (the model, or the wrapper that gathers or reduces around it)
        optimizer   a torch.optim.Optimizer: what schedulers edit and checkpoints read the state of
        offload     the host or disk tier (zero/tiers.py) when spec.offload is set, else None
    Class attributes:
        shards          each rank holds a different piece of the gradients (their squares add up
                        over ranks)
        has_replicated  some gradients are equal on every data-parallel rank (DDP's; ZeRO-3's whole
                        ones)
    """

    shards: bool = True
    has_replicated: bool = False
    # no wrapper does it: rank 0's buffers before a training forward
    broadcasts_buffers: bool = False

    def __init__(self, model: torch.nn.Module, comm, spec: StrategySpec):
        self.model = model
        self.comm = comm
        self.spec = spec
        self.offload = None
        self.wrapped = model
        self.optimizer = None

    # ------------------------------------------------------------------
    # the step (each strategy's own)
    @abstractmethod
    def reduced_grads(self) -> Grads:
        """At the boundary: the averaged fp32 gradients this rank holds, sharded or replicated."""

    @abstractmethod
    def grad_names(self, name_of: dict) -> tuple[list, list]:
        """Per tensor of reduced_grads(): its parameter's name, or ([(name, lo, numel)], numel) for
        a flat piece."""

    @abstractmethod
    def apply(self):
        """Step what this rank owns with the reduced gradients, and make the model's parameters
        follow."""

    @abstractmethod
    def zero_grad(self):
        """Forget this step's gradients."""

    @abstractmethod
    def segments(self, name_of: dict) -> list:
        """[Segment]: the fp32 tensors the optimizer steps, piece by piece (what a checkpoint
        writes)."""

    # ------------------------------------------------------------------ shared by the strategies
    @staticmethod
    def trainable(model) -> list:
        """The model's trainable parameters, each once (tied weights appear under two names)."""
        return list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))

    def plain_or_mixed_optimizer(self, params, comm):
        """The user's optimizer class on the parameters (fp32), or over fp32 masters of 16-bit
        ones."""
        from minizero.precision import MixedPrecisionOptimizer
        spec, kw = self.spec, self.spec.optimizer_kwargs
        if spec.mixed_precision:
            return MixedPrecisionOptimizer(params, spec.optimizer_cls, None, 0.0, comm, **kw)
        return spec.optimizer_cls(params, **kw)

    # ------------------------------------------------------------------ hooks with a default
    def forward_prelude(self):
        """Before a training forward: rank 0's buffers, as DDP does, where no wrapper sends them."""
        if self.broadcasts_buffers and torch.is_grad_enabled():
            self.comm.broadcast_tensors(list(self.model.buffers()))

    def backward_context(self, boundary: bool):
        """DDP accumulates locally until the boundary (no_sync); the others reduce every
        backward."""
        return nullcontext()

    def hold_gradients(self):
        """While ANOTHER engine's backward runs through this model (a GAN's generator loss through
        the discriminator): its gradients stay out of this engine's reduction, as with torch, where
        they stay in p.grad until the discriminator's zero_grad(). Default: nothing reduces during
        backward (ZeRO-1)."""
        return nullcontext()

    def norm_comm(self, world):
        """The ranks over which the sharded gradients' squares add up to the model's (None: none are
        sharded)."""
        return world if self.shards else None

    def writes(self, segment: Segment) -> bool:
        """Whether this rank writes `segment` to a checkpoint (a replicated one is written once)."""
        return not segment.replicated or self.comm.rank == 0

    def param_names(self, names: dict) -> dict:
        """{id(trained tensor): name}: `names` maps the model's own parameters; ZeRO-3 trains local
        parts."""
        return names

    def expert_names(self, name_of: dict) -> set:
        """Names of the expert parameters counted per expert-data-parallel group in the norm
        (MoE)."""
        return set()

    def memory_objects(self) -> tuple:
        """What the ledger walks (memory.measure)."""
        return (self.wrapped, self.optimizer)

    def offload_traffic(self) -> dict:
        return self.offload.traffic.as_dict() if self.offload is not None else {}

    def finish_offload(self):
        """DPU: the update in flight lands (before the next step, a checkpoint, the end)."""
        if self.offload is not None:
            self.offload.finish()

    def unsharded_largest(self) -> int | None:
        """ZeRO-3 that shards nothing (every tensor under the persistence threshold): the largest
        tensor's elements, for the user's note; None where something is sharded or nothing
        shards."""
        return None

    def check_checkpointable(self):
        """Raise (the same on every rank, before any collective) if this strategy's state cannot be
        saved."""

    def after_load(self, master_of: Callable, stateful: Callable, name_of: dict):
        """After a checkpoint wrote the fp32 masters: make the model's parameters follow.
        stateful(name): whether the checkpoint gave that parameter optimizer state (None: the
        optimizer state was not loaded)."""


# ---------------------------------------------------------------------------------------- DDP
class DDPStrategy(Strategy):
    """Stage 0: every rank holds everything; gradients all-reduced in buckets (minizero.dp.ddp)."""

    shards = False
    has_replicated = True

    def __init__(self, model, comm, spec):
        super().__init__(model, comm, spec)
        self.ddp = self._wrapper(model, comm, spec)
        self.wrapped = self.ddp or model
        self.params = self.ddp.params if self.ddp is not None else self.trainable(model)
        self.optimizer = self.plain_or_mixed_optimizer(spec.groups or self.params, comm)

    def _wrapper(self, model, comm, spec):
        """torch DDP's role (it broadcasts rank 0's model); a pipeline of one data-parallel rank
        reduces nothing: no wrapper."""
        from minizero.dp.ddp import DDP
        if spec.runtime_syncs and comm.size == 1:
            return None
        return DDP(model, comm, bucket_numel=spec.bucket_numel, overlap=spec.overlap)

    def backward_context(self, boundary: bool):
        if self.ddp is None:
            return nullcontext()
        if not boundary:
            return self.ddp.no_sync()
        return nullcontext() if self.spec.runtime_syncs else self._synced()

    @contextmanager
    def _synced(self):
        """Average at the end of each boundary backward, as DeepSpeed's engine does
        (allreduce_gradients): a second backward before step() (a GAN's real and fake halves) then
        adds its local gradient to the average and the next average is the mean of the sum (the mean
        is linear)."""
        yield
        if self.ddp._pending:
            self.ddp.finish_gradient_synchronization()

    def hold_gradients(self):
        return self.ddp.no_sync() if self.ddp is not None else nullcontext()

    def _trained(self):
        """(model parameter, the fp32 tensor stepped for it) in order."""
        opt = self.optimizer
        return (
            list(zip(opt.params, opt.masters))
            if self.spec.mixed_precision
            else [(p, p) for p in self.params]
        )

    def reduced_grads(self) -> Grads:
        if self.ddp is not None and not self.spec.runtime_syncs and self.ddp._pending:
            self.ddp.finish_gradient_synchronization()
        if not self.spec.mixed_precision:
            return Grads([], [p.grad for p in self.params if p.grad is not None])
        for p, m in self._trained():
            m.grad = None if p.grad is None else p.grad.float()
        return Grads([], [m.grad for _, m in self._trained() if m.grad is not None])

    def grad_names(self, name_of):
        """Per tensor of reduced_grads(): its parameter's name (for norm weights)."""
        return [], [name_of[id(p)] for p, _ in self._trained() if p.grad is not None]

    @torch.no_grad()
    def apply(self):
        if not self.spec.mixed_precision:
            self.optimizer.step()
            return
        self.optimizer.step_masters()
        for p, m in self._trained():
            p.copy_(m)  # round the fp32 masters into the 16-bit model

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)
        for _, m in self._trained():
            m.grad = None

    def segments(self, name_of: dict) -> list:
        inner = self.optimizer.optimizer if self.spec.mixed_precision else self.optimizer
        return [Segment(t, inner, [SegmentPiece(name_of[id(p)], 0, t.numel(), 0, t in inner.state)],
                        True)
                for p, t in self._trained()]

    @torch.no_grad()
    def after_load(self, master_of, stateful, name_of):
        if self.spec.mixed_precision:
            for p, m in self._trained():
                p.copy_(m)


# ---------------------------------------------------------------------------------------- ZeRO-1/2
class FlatStrategy(Strategy):
    """ZeRO-1 and ZeRO-2: one flat buffer (zero/flat_layout.py), this rank steps its 1/N shard."""

    @abstractmethod
    def _local_grad_shard(self) -> torch.Tensor:
        """This rank's reduced gradient shard (ZeRO-1 reduce-scatters it now; ZeRO-2 did in
        backward)."""

    def reduced_grads(self) -> Grads:
        # fp32, where the step uses it: the device shard (a
        # copy of a 16-bit one), or the host tier's buffer
        self._shard_grad = self.optimizer.gradient_for_step(self._local_grad_shard())
        return Grads([self._shard_grad], [])

    def grad_names(self, name_of):
        """The one shard gradient: [(name, shard_lo, numel)] of the pieces this rank holds, and its
        size."""
        opt = self.optimizer
        return [([(name_of[id(opt.params[pc.index])], pc.shard_lo, pc.hi - pc.lo)
                  for pc in opt.layout.pieces(self.comm.rank)], opt.layout.shard_numel)], []

    @torch.no_grad()
    def apply(self):
        # step the fp32 shard (device or host), all-gather
        self.optimizer.step_gradient(self._shard_grad)

    def segments(self, name_of):
        opt = self.optimizer
        # the host optimizer steps the whole shard, every element every step
        if self.offload is not None:
            return [Segment(opt.master, self.offload,
                            [SegmentPiece(name_of[id(opt.params[pc.index])], pc.lo, pc.hi,
                                          pc.shard_lo, True)
                             for pc in opt.layout.pieces(self.comm.rank)], False)]
        return run_segments(opt, name_of)

    @torch.no_grad()
    def after_load(self, master_of, stateful, name_of):
        opt = self.optimizer  # every rank holds the full (16-bit) flat parameters
        for p, v in zip(opt.params, opt.layout.views(opt.flat)):
            v.copy_(master_of(name_of[id(p)]).view(v.shape))
        # which have state now (the host tier steps every element)
        if self.offload is None and stateful is not None:
            opt.stepped = {i for i, p in enumerate(opt.params) if stateful(name_of[id(p)])}


class Zero1Strategy(FlatStrategy):
    """Stage 1: optimizer state sharded (zero.ShardedOptimizer); the model is the user's,
    unwrapped."""

    broadcasts_buffers = True

    def __init__(self, model, comm, spec):
        super().__init__(model, comm, spec)
        from minizero.zero.sharded_optimizer import ShardedOptimizer

        comm.broadcast_tensors(
            [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
        )
        self.optimizer = ShardedOptimizer(spec.groups or model.parameters(), spec.optimizer_cls,
                                          comm, offload=spec.offload,
                                          master_dtype=spec.master_dtype, **spec.optimizer_kwargs)
        self.offload = self.optimizer.tier
        self._shard_grad = None

    def _local_grad_shard(self):
        return self.optimizer.reduce_gradients()

    def zero_grad(self):
        self.optimizer.zero_grad()
        self._shard_grad = None

    def memory_objects(self):
        # offloaded: the tier first (its explicit host locations win for the storages it shares)
        return (
            (self.offload, self.model) if self.offload is not None else (self.model, self.optimizer)
        )


class Zero2Strategy(FlatStrategy):
    """Stage 2: gradients sharded too (zero.ShardGradOp reduce-scatters bucket by bucket in
    backward)."""

    def __init__(self, model, comm, spec):
        super().__init__(model, comm, spec)
        from minizero.zero.shard_grad_op import ShardGradOp
        self.wrapped = ShardGradOp(model, spec.optimizer_cls, comm, bucket_numel=spec.bucket_numel,
                                   overlap=spec.overlap, params=spec.groups, offload=spec.offload,
                                   master_dtype=spec.master_dtype, **spec.optimizer_kwargs)
        self.optimizer = self.wrapped.optim
        self.offload = self.optimizer.tier
        self._shard_grad = None

    def _local_grad_shard(self):
        return self.wrapped.grad_shard

    def zero_grad(self):
        self.wrapped.zero_grad()
        self._shard_grad = None

    def hold_gradients(self):
        return self.wrapped.no_sync()  # full gradients stay in p.grad, as torch leaves them

    def memory_objects(self):
        return (self.offload, self.wrapped) if self.offload is not None else (self.wrapped,)


def run_segments(opt, name_of) -> list:
    """The runs of a FlatShardOptimizer's shards (zero/flat_shard_optimizer.py), one state per
    run."""
    return [Segment(run.tensor, opt.optim,
                    [SegmentPiece(name_of[id(opt.params[i])], lo, hi, off, i in opt.stepped)
                     for i, lo, hi, off in run.pieces], run.replicated)
            for run in opt.runs]


# ---------------------------------------------------------------------------------------- ZeRO-3
class Zero3Strategy(Strategy):
    """Stage 3: parameters sharded too (zero.FSDP, or zero.ZeroPP for ZeRO++),
    zero.FSDPOptimizer."""

    def __init__(self, model, comm, spec):
        super().__init__(model, comm, spec)
        from minizero.zero.fsdp_optimizer import FSDPOptimizer
        # rank 0's model reaches every rank once, in FSDP (sync_module_states), after its debug
        # check
        self.wrapped = self._wrap(model, comm, spec, dict(
            compute_dtype=spec.dtype if spec.mixed_precision else None, prefetch=spec.prefetch,
            persistence_threshold=spec.persistence_threshold, shard_layout=spec.shard_layout))
        # buffers and frozen parameters (the local parts stay fp32 shard views)
        if spec.zero_init is not None:
            trained = {id(p) for p in self.wrapped.parameters() if p.requires_grad}
            device = comm.device
            for t in [*model.buffers(), *(p for p in model.parameters() if id(p) not in trained)]:
                t.data = t.data.to(
                    device, spec.dtype if spec.mixed_precision and t.is_floating_point() else None
                )
        self.optimizer = FSDPOptimizer(self.wrapped, spec.optimizer_cls, spec.groups,
                                       offload=spec.offload, **spec.optimizer_kwargs)
        self.offload = self.optimizer.tier
        self._whole = {id(t) for _, part, t, _, _ in self.wrapped.flat_parts() if part == "whole"}
        self.has_replicated = bool(self._whole)  # the same on every rank: the units are cut alike

    def _wrap(self, model, comm, spec, kw):
        """FSDP over the data-parallel ranks, or ZeroPP (FSDP with ZeRO++'s collectives) over its
        nodes."""
        from minizero.zero.fsdp import FSDP
        if spec.zeropp is None:
            return FSDP(model, comm, **kw)
        from minizero.zero.zeropp import ZeroPP
        pp = spec.zeropp
        return ZeroPP(model, spec.node_mesh, quantized_weights=pp.quantized_weights,
                      hpz=pp.hpz_partition_size > 1, quantized_gradients=pp.quantized_gradients,
                      **kw)

    def param_names(self, names):
        # FSDP's local parts carry the original names
        return {id(p): n for n, p in self.wrapped.named_parameters()}

    def unsharded_largest(self) -> int | None:
        return self.wrapped.largest_tensor_numel() if self.wrapped.sharded_numel() == 0 else None

    def reduced_grads(self) -> Grads:
        if self.offload is not None:  # already on the host, moved unit by unit during backward
            pairs = list(zip(self.offload.device_params, self.offload.grads))
            return Grads([g for p, g in pairs if id(p) not in self._whole],
                         [g for p, g in pairs if id(p) in self._whole])
        opt = self.optimizer
        parts = list(zip(opt.parts, opt.grads()))  # FSDP's flat fp32 gradients, unit by unit
        return Grads([g for (_, name), g in parts if name == "shard" and g is not None],
                     [g for (_, name), g in parts if name == "whole" and g is not None])

    def grad_names(self, name_of):
        """Per gradient tensor: ([(name, lo, numel)], numel) of the unit shard or persistent
        spec."""
        fsdp, shards, wholes = self.wrapped, [], []
        for u, part, _, numel, pieces in fsdp.flat_parts():
            if self.offload is not None or fsdp.unit_grad(u, part) is not None:
                (shards if part == "shard" else wholes).append(
                    ([(name, off, hi - lo) for name, lo, hi, off in pieces], numel))
        return shards, wholes

    @torch.no_grad()
    def apply(self):
        # on the device, or on the tier (its gradients went down during backward)
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def hold_gradients(self):
        # on the device the averaged gradients land in the local parts' .grad, which the model's
        # zero_grad() clears as torch's would; offloaded they
        # go to the host, out of its reach: dropped instead
        return self.wrapped.drop_gradients() if self.offload is not None else nullcontext()

    def segments(self, name_of):
        if self.offload is None:
            return run_segments(self.optimizer, name_of)
        # the host optimizer steps whole flat shards, every element every step
        return [Segment(self.offload.master_of(t), self.offload,
                        [SegmentPiece(name, lo, hi, off, True) for name, lo, hi, off in pieces],
                        part == "whole")
                for _, part, t, _, pieces in self.wrapped.flat_parts()]

    def after_load(self, master_of, stateful, name_of):
        if self.offload is not None:
            # the checkpoint wrote the tier's fp32 masters: the device shards (16-bit, or fp32)
            # follow; the disk tier's masters are the device shards, so its files follow them
            if self.offload.masters is self.offload.device_params:
                self.offload.sync_masters_from_device()
            else:
                self.offload.params_to_device()
        elif stateful is not None:
            opt = self.optimizer
            opt.stepped = {i for i, p in enumerate(opt.params) if stateful(name_of[id(p)])}

    def memory_objects(self):
        # the optimizer first: an offloaded one says where its tensors live
        return (self.optimizer, self.wrapped)


# ----------------------------------------------------------------------------------------
# 1-bit Adam
class OneBitAdamStrategy(Strategy):
    """Stage 0 with 1-bit Adam (compression/onebit_adam.py; Tang et al. 2021): every rank holds
    everything. During the warm-up the gradients are all-reduced at the boundary, as DeepSpeed's
    engine does until freeze_step; then they stay this rank's own and the optimizer all-reduces the
    momentum in 1 bit per element (one flat buffer: 2 collectives a step). A clip then clips each
    rank's own gradients, as DeepSpeed's clip_fp32_gradients does."""

    broadcasts_buffers = True
    shards = False
    has_replicated = True

    def __init__(self, model, comm, spec):
        super().__init__(model, comm, spec)
        # one start on every rank, as DDP's
        comm.broadcast_tensors([*model.parameters(), *model.buffers()])
        self.params = self.trainable(model)
        self.optimizer = spec.optimizer_cls(spec.groups or self.params, comm, per_tensor=False,
                                            grads_averaged=True, **spec.optimizer_kwargs)
        # The warm-up's gradients live in one flat buffer (as DDP's gradient_as_bucket_view): a
        # hook moves each new .grad into its slot and makes .grad the slot, so the boundary
        # all-reduces the buffer in place, with no concatenation and no copy back. Freed once
        # compression starts.
        self._flat_grad = None
        if comm.size > 1 and self.params:
            self._flat_grad = torch.zeros(sum(p.numel() for p in self.params),
                                          dtype=self.params[0].dtype, device=self.params[0].device)
            parts = self._flat_grad.split([p.numel() for p in self.params])
            self._slots = [v.view_as(p) for p, v in zip(self.params, parts)]
            self._hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: self._into_flat(i))
                           for i, p in enumerate(self.params)]

    def _into_flat(self, i: int):
        p, slot = self.params[i], self._slots[i]
        if self._flat_grad is not None and p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
            p.grad = slot  # autograd's own tensor is freed; accumulation adds into the slot

    def reduced_grads(self) -> Grads:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self._flat_grad is not None and self.optimizer.compressing:  # the warm-up is over
            for h in self._hooks:
                h.remove()
            self._flat_grad = self._slots = None
        if self._flat_grad is not None and grads:  # the warm-up: one flat all-reduce, in place
            for p, slot in zip(self.params, self._slots):
                if p.grad is None:
                    slot.zero_()  # unused this step: zeros, so every rank sends the same buffer
            self.comm.all_reduce(self._flat_grad, op="avg")
        # after the warm-up: this rank's own (the momentum is reduced inside the step)
        return Grads([], grads)

    def grad_names(self, name_of):
        return [], [name_of[id(p)] for p in self.params if p.grad is not None]

    @torch.no_grad()
    def apply(self):
        self.optimizer.step()

    def memory_objects(self):
        flat = () if self._flat_grad is None else (_Held("gradients", self._flat_grad),)
        return (self.wrapped, self.optimizer, *flat)  # the warm-up's buffer, also between steps

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def segments(self, name_of):
        return [Segment(p, self.optimizer,
                        [SegmentPiece(name_of[id(p)], 0, p.numel(), 0, p in self.optimizer.state)],
                        True)
                for p in self.params]

    def check_checkpointable(self):
        raise NotImplementedError("checkpoints with optimizer.type 'OneBitAdam' are not "
                                  "implemented: its worker and server error buffers differ on "
                                  "every rank and the format keeps one copy of a replicated "
                                  "parameter's state")


# ----------------------------------------------------------------------------------------
# hybrid sharding
class HybridShardStrategy(Zero3Strategy):
    """ZeRO-3 inside each node, whole replicas across nodes (zero.HybridShard; DeepSpeed's MiCS,
    zero_optimization.mics_shard_size = the ranks per node; FSDP's HYBRID_SHARD). Everything else is
    ZeRO-3's: what differs is where the shards' squares add up and which rank writes a shard."""

    def _wrap(self, model, comm, spec, kw):
        from minizero.zero.hybrid import HybridShard
        self.mesh = spec.node_mesh  # mesh.node shards, mesh.cross_node replicates
        return HybridShard(model, self.mesh, **kw)

    def norm_comm(self, world):
        # every node holds the whole model in shards: its squares are the model's
        return self.mesh.node

    def writes(self, segment):
        # one node writes its shards (the others hold the
        # same); its first rank writes the replicated parts
        return self.mesh.cross_node.rank == 0 and (
            not segment.replicated or self.mesh.node.rank == 0
        )


def norm_weights(grads: Grads, layout, weight_of: Callable | None, device) -> tuple[list, list]:
    """Per-element weights of reduced_grads() for the global norm (1: counted here; 1/t: a tensor
    every tp rank holds whole; 0: a tied copy another stage counts). None everywhere when weight_of
    is None. layout: strategy.grad_names(name_of): per tensor a parameter name (DDP) or ([(name, lo,
    numel)], numel)."""
    if weight_of is None:
        return [None] * len(grads.sharded), [None] * len(grads.replicated)

    def weights(entry):
        if isinstance(entry, str):  # one whole parameter
            return weight_of(entry)
        pieces, numel = entry
        w = torch.zeros(numel, device=device)
        for who, lo, n in pieces:
            w[lo:lo + n] = weight_of(who)
        return w
    sharded, replicated = layout
    return [weights(e) for e in sharded], [weights(e) for e in replicated]

