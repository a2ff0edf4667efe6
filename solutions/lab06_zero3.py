# Lab 06: ZeRO-3 / FSDP: gather and free hooks
# GENERATED from minizero/zero/fsdp.py by `make labs`. Edit nothing: this is the reference solution.
#   run:   mpirun -n 4 python solutions/lab06_zero3.py
#   check: python -m minizero_course grade --lab 6 --impl solutions    (or: pytest -m lab6 --impl solutions)
"""minizero.zero.fsdp: ZeRO stage 3 / FSDP. Parameters are sharded too, gathered a unit at a time.

ZeRO (Rajbhandari et al. 2020, Sec. 5.3, P_os+g+p): each of N ranks keeps 1/N of the parameters,
gradients AND optimizer state, (2 + 2 + K)Ψ/N bytes instead of DDP's (2 + 2 + K)Ψ; a layer's full
weights exist only while it computes. The price (Sec. 7.2.2) is one more all-gather per step:
all-gather (forward) + all-gather (backward) + reduce-scatter = 3(N-1)/N·Ψ·b bytes sent per rank,
1.5x DDP's all-reduce 2(N-1)/N·Ψ·b.

    model = FSDP(TinyGPT(cfg))                        # the same seed on every rank
    # or torch.optim.Adam(model.parameters(), lr)
    opt = FSDPOptimizer(model, torch.optim.Adam, lr=lr)
    loss = model(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()
    full = model.gather_full_params()                 # a collective: every rank calls it

Units (PyTorch FSDP's flat parameters, Zhao et al. 2023): one wrapped module and the trainable
parameters under it that no inner unit claims, packed by FlatLayout and cut in N; rank r keeps
slice r as one fp32 nn.Parameter, `unit.shard`. The module is the root unit; `wrap` picks the
others: module classes, a predicate (name, module) -> bool, or None = each element of an
nn.ModuleList (TinyGPT: root = wte, wpe, ln_f, lm_head; a unit per block h.i). A weight tied
across units belongs, once, to their closest common enclosing unit. Frozen parameters stay whole
in the module, never sharded or reduced (parameters() yields them; optimizers skip them: no
.grad). Parameters under `persistence_threshold` elements (DeepSpeed's
stage3_param_persistence_threshold) stay whole on every rank (`unit.whole`), are not gathered,
and have their gradients all-reduced: a collective per tiny bias would be all latency.

shard_layout="per_param" cuts differently, as torch's FSDP2 (fully_shard) does
(per_param_layout.py): every sharded parameter on dim 0 into N pieces of ceil(dim0 / N) rows, zero
rows padding the last ranks', so a parameter's pieces have one size on every rank; p.shape is this
rank's rows (FSDP2's to_local().shape), p.grad the same rows of the averaged gradient (to_local(),
full_tensor()). The units, hooks and collectives stay the same: the all-gather still moves one
buffer per unit (rank-major: [rank 0's pieces | rank 1's | ...]), which one copy puts in parameter
order before compute, and the gradient is put back in rank order before its one reduce-scatter
(FSDP2's copy-out and chunk_cat). Padding is sent and held: (N-1)·S·b bytes per collective, S = Σ
ceil(dim0/N)·row elements per rank instead of ceil(Ψ/N).

A step, unit by unit: the forward pre-hook all-gathers the unit's shards into a fresh flat buffer
(or waits for its prefetch) and points the module's parameter attributes at views of it; the
post-hook frees it; backward gathers the unit again when it first needs one of its weights; when the
unit's gradient is complete it is reduce-scattered (avg) into the parameters' .grad and the unit is
freed. How, with public torch 2.13 API, the same on CPU and CUDA:
  * the buffer enters autograd through _Gather, a Function of the shard whose backward is the
    transpose of an all-gather, a reduce-scatter. The views are split()s of its output, so unit's
    gradients meet in ONE node, run once when complete (unused parameters and padding get
    zeros from SplitBackward), and _accumulate adds its result into the parameters' .grad;
  * saved_tensors_hooks see every tensor autograd saves: a view of a gathered buffer is saved as
    a _ParamRef (unit + strides), so after forward nothing holds the buffer, and unpacking one
    gathers unit again. (Hooks on module outputs fire too early or never; resizing storage to 0,
    FSDP's trick, fails here: mpi4py's numpy views pin the storage.)
Prefetch: the next unit's all-gather is in flight while this one computes (forward: the last
forward's order; backward: the next unvisited unit in reverse). counters["prefetch_hits"]
counts gathers issued before they were needed; `events` is the last step's schedule. On CPU,
MPI progresses nonblocking collectives mostly inside MPI calls: little real overlap here.

compute_dtype (bf16/fp16): shards are cast BEFORE the all-gather (half the bytes); units compute,
and gradients are reduce-scattered, in it; the fp32 shards are the master copy ("master_params"
in the ledger) and 16-bit weights exist only while gathered. Buffers and frozen params keep theirs.

The model's parameters, as a user sees them (torch's conventions; FSDP2 and FSDP1's
use_orig_params=True do the same): named_parameters() / parameters() yield every parameter under
its ORIGINAL name (no "module." prefix), and as the ORIGINAL Parameter object (FSDP1's
use_orig_params: an optimizer built before wrapping, nanoGPT's order, trains it), its .data now this
rank's local part, a 1-D view of unit.shard holding the elements this rank owns (maybe none):
p.shape and p.numel() count this rank's elements, `p.full_shape` is the shape before sharding, and
the local parts of all ranks add up to Ψ (padding is no parameter's). A persistent one is its whole
self, a view of unit.whole. Their .grad are views of one flat fp32 gradient per unit (freed with the
last of them); a parameter no rank used keeps .grad None, so torch's optimizers skip it, as they
would without FSDP. A plain torch optimizer on model.parameters() therefore works; FSDPOptimizer
(fsdp_optimizer.py) steps the same elements as one run per unit. The owner module's attribute
(module.fc1.weight) is a full-shape tensor: the gathered view in forward and backward, between
steps a meta-device placeholder, so code reading weight.shape (an extra_repr, print(model))
works while reading its values fails loudly; use gather_full_params() or state_dict()
(collectives: the full values under the original names) and load_state_dict().

Rules: every rank starts from rank 0's parameters (sync_module_states=True, as torch DDP broadcasts
at construction; debug=True first checks that they were equal anyway) and runs the same units in the
same order, so all issue the same collectives, also for a parameter unused in a step (a zero slice
of its unit's gradient). A unit whose weights no backward op reads (only biases) is not gathered
again: fewer bytes than 3(N-1)/N·Ψ. Buffers stay replicated: rank 0's at construction and, with
broadcast_buffers (the default, as torch DDP), before every forward under grad mode, so BatchNorm
statistics cannot drift apart ((N-1)/N of the buffers' bytes per forward, counted as "broadcast").
"""
from __future__ import annotations

import itertools
import math
import time
import weakref
from contextlib import contextmanager

import torch
import torch.nn as nn

from minizero import comm as comm_mod
from minizero import memory, precision
from minizero.comm.labels import labelled
from minizero.zero.flat_layout import FlatLayout
from minizero.zero.init import built_with_init
from minizero.zero.per_param_layout import PerParamLayout
from minizero.zero.sharded_grad import is_placeholder, placeholder_grad, sharded_grad

_IDS = itertools.count()
SHARD_LAYOUTS = {"flat": FlatLayout, "per_param": PerParamLayout}  # the shard_layout= choices


class _ParamRef:
    """Saved for backward instead of a view of a gathered buffer: which unit, which view."""
    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit, t):
        self.unit, self.size, self.stride, self.offset = (
            unit,
            t.size(),
            t.stride(),
            t.storage_offset(),
        )


class _Gather(torch.autograd.Function):
    """Identity on the already gathered unit.buf in forward; reduce-scatter in backward."""

    @staticmethod
    def forward(ctx, fsdp, unit, shard, whole):
        ctx.fsdp, ctx.unit = fsdp, unit
        return unit.buf

    @staticmethod
    def backward(ctx, g):
        return (None, None) + ctx.fsdp._reduce_grads(ctx.unit, g.contiguous())


def _refuse_shard_state_dict(module, prefix, keep_vars):
    """A state_dict() pre-hook on every module that holds a sharded local part: its own state_dict()
    would return this rank's 1-D pieces under the full names (nanoGPT's
    `raw_model.state_dict()`)."""
    raise RuntimeError(f"state_dict() of {type(module).__name__} "
                       f"{prefix.rstrip('.') or '(the wrapped model)'}: its parameters are this "
                       "rank's FSDP shards. Call model.state_dict() on the FSDP wrapper on EVERY "
                       "rank (a collective: full tensors under these names, torch FSDP's "
                       "FULL_STATE_DICT), then save on rank 0")


class _Unit:
    """One flat parameter. entries: (shape, [(owner module, attr)], [names]); the first n_sharded
    are sharded, the rest persistent. Its gathered buffer: [sharded | padding | persistent]
    (per_param: [p0 | p0's padding rows | p1 | ... | persistent], once to_compute has reordered the
    all-gather's)."""

    def __init__(self, name, module, sharded, persistent, comm, materialize=None,
                 layout_cls=FlatLayout):
        self.name = name or "root"       # the wrapped module's name
        self.module = module             # its hooks gather and free this unit
        self.n_sharded = len(sharded)    # entries[:n_sharded] are sharded, the rest persistent
        # shapes only: holding the original Parameters would keep the full model alive
        self.entries = [(p.shape, slots, names) for p, slots, names in sharded + persistent]
        self.layout = layout_cls([p.shape for p, _, _ in sharded], comm.size)
        self.gathered_numel = self.layout.padded_numel  # elements all-gathered (sharded + padding)
        # elements kept whole on every rank
        self.persistent_numel = sum(p.numel() for p, _, _ in persistent)
        segments = self.layout.compute_sizes() + [(p.numel(), True) for p, _, _ in persistent]
        self.sizes = [n for n, _ in segments]  # split() of the gathered buffer ...
        # ... and which are entries
        self.kept = [k for k, (_, is_entry) in enumerate(segments) if is_entry]
        self.shard = (
            nn.Parameter(torch.empty(self.layout.shard_numel, device=comm.device))
            if self.gathered_numel
            else None
        )
        self.whole = (
            nn.Parameter(torch.empty(self.persistent_numel, device=comm.device))
            if self.persistent_numel
            else None
        )
        tensors = [p for p, _, _ in sharded + persistent]
        # zero.Init: one unit
        self.load([materialize(t) for t in tensors] if materialize else tensors, comm.rank)
        # the user's, not kept alive
        self.originals = [weakref.ref(p) for p, _, _ in sharded + persistent]
        self.visible = []  # per entry: the Parameter now registered under its original name(s)
        self.slots = {}  # "shard"/"whole" -> [(entry, offset, numel, lo)]: visible one's place, and
                                 # where its elements start in the flattened full parameter
        # per entry: a full-shape meta tensor, the module attribute between steps
        self.placeholders = []
        self.used = set()        # entries whose gathered view got a gradient in this backward
        self.grads = {}  # "shard"/"whole" -> weakref to the flat gradient the visible .grads view
        self.buf = None          # the gathered buffer, while it exists
        self.work = None         # the in-flight all-gather into it
        self.src = None          # the shard cast to compute_dtype, while its gather is in flight
        self.prefetched = False  # gathered ahead of need in this step
        self.visited = False     # its backward gather is done in this step

    @torch.no_grad()
    def load(self, tensors, rank, shard=None, whole=None):
        """Take this rank's slice of the full tensors (in entries order), into `shard` / `whole`
        (default: its own; FSDP.load_state_dict also fills the host's fp32 masters when the device
        keeps 16-bit shards)."""
        shard = self.shard if shard is None else shard
        whole = self.whole if whole is None else whole
        if self.gathered_numel:
            shard.copy_(self.layout.shard(self.layout.flatten(tensors[:self.n_sharded],
                                                              torch.float32,
                                                                   shard.device), rank))
        if self.persistent_numel:
            whole.copy_(torch.cat([t.reshape(-1).float() for t in tensors[self.n_sharded:]]))

    def split(self, flat):
        """Views of a full flat buffer, one per entry, shaped like the parameters."""
        views = flat.split(self.sizes)  # one autograd node: the unit's gradients meet in it
        return [views[k].view(shape) for k, (shape, _, _) in zip(self.kept, self.entries)]


class FSDP(nn.Module):
    def __init__(self, module: nn.Module, comm: comm_mod.Communicator | None = None,
                 compute_dtype=None, prefetch: bool = True, persistence_threshold: int = 0,
                 wrap=None, debug: bool | None = None, broadcast_buffers: bool = True,
                 sync_module_states: bool = True, shard_layout: str = "flat"):
        # shard_layout: "flat" (each unit one buffer cut in N) or "per_param" (FSDP2's dim-0
        # pieces); docstring
        super().__init__()
        if shard_layout not in SHARD_LAYOUTS:
            raise ValueError(f"FSDP: shard_layout must be one of {sorted(SHARD_LAYOUTS)}, got "
                             f"{shard_layout!r}")
        if shard_layout != "flat" and (
            type(self)._gather_shards is not FSDP._gather_shards
            or type(self)._reduce_shard_grad is not FSDP._reduce_shard_grad
        ):
            raise ValueError(f"{type(self).__name__}: shard_layout={shard_layout!r} is for plain "
                             "FSDP; its own gathers and reduces cut flat units (use "
                             "shard_layout='flat')")
        # "flat": units cut as one buffer; "per_param": FSDP2's dim-0 pieces
        self.shard_layout = shard_layout
        if isinstance(module, FSDP) or any(
            getattr(m, "_zero3_wrapped", False) for m in module.modules()
        ):
            raise ValueError("FSDP: this module is already wrapped by FSDP (its parameters are "
                             "flat shards now). Wrap the plain module once; use `wrap=` to choose "
                             "the inner units.")
        if compute_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError("compute_dtype must be None, torch.bfloat16 or torch.float16, got "
                             f"{compute_dtype}")
        self.module = module  # the wrapped model (torch's convention: .module)
        self.comm = comm or comm_mod.get()
        # None: fp32, no cast
        self.compute_dtype = None if compute_dtype == torch.float32 else compute_dtype
        self.prefetch = prefetch  # gather the next unit while this one computes
        self.dtype = compute_dtype or torch.float32  # what the units compute and reduce in
        self.debug = self.comm.debug if debug is None else debug
        # rank 0's buffers before every forward (torch DDP's default)
        self.broadcast_buffers = broadcast_buffers
        self._tag = f"zero3#{next(_IDS)}"
        # built under zero.Init: materialized here, one unit at a time
        self._init = built_with_init(module)
        if self._init is not None:
            # buffers and frozen parameters: small, whole everywhere
            self._init.materialize_replicated(module)
        elif self.debug and self.comm.size > 1:
            self._check_same_params()  # before the broadcast below hides a difference
        if sync_module_states and self._init is None:
            # rank 0's parameters, as torch DDP (and FSDP's sync_module_states=True): ranks seeded
            # differently (nanoGPT's 1337 + rank) would otherwise each keep the shard of a different
            # model. Ψ elements once.
            self.comm.broadcast_tensors(list(module.parameters()))
        self.comm.broadcast_tensors(list(module.buffers()))  # replicated: rank 0's win (as in DDP)
        # state_dict() order: parameter names (tied ones under every name) and buffers
        self._keys = list(module.state_dict().keys())
        self.units = self._build_units(module, wrap, persistence_threshold)
        self._visible_ids = set()       # id() of every Parameter _expose registered
        self._replaced = {}  # id(original Parameter) -> (weakref to it, its local Parameter)
        for unit in self.units:
            self._expose(unit)  # the originals leave the module; their local parts take their names
            self._install(unit, None)
            unit.module.register_forward_pre_hook(lambda m, args,
                                                  unit=unit: self._pre_forward(unit))
            unit.module.register_forward_hook(lambda m, args, out,
                                              unit=unit: self._post_forward(unit))
        module._zero3_wrapped = True
        self._saved_from = {}           # storage ptr of a gathered forward buffer -> unit
        self._order = self.units        # forward order of the units: the last forward's
        self._record = []               # ... and this forward's, as it happens
        self.counters = {"gathers": 0, "prefetch_hits": 0}
        self.events = []                # this step's schedule: (seconds, what, unit)
        # offload_param: fn(unit, shard) -> a device copy, before each all-gather
        self.fetch_shard = None
        # inside forward(); a unit run outside it (an activation-checkpoint
        self._forwarding = False
                                        # recompute in backward) gathers itself
                                        # but neither records nor prefetches
        self._dropping = False          # inside drop_gradients(): backward reduces nothing
        self.grad_sink = None  # offload: fn(unit, part, flat fp32 grad) takes each reduced gradient
        self.masters = None  # offload with 16-bit shards: fn(unit, part) -> the host fp32 master

    # ------------------------------------------------------------------ construction
    @torch.no_grad()
    def _expose(self, unit):
        """Register each of unit's parameters under its original name(s) as this rank's local part:
        the elements of it this rank's shard holds (flattened, maybe none), a view of unit.shard, or
        for a persistent one the whole tensor, a view of unit.whole. `p.full_shape` is the full
        shape."""
        pieces = {pc.index: pc for pc in unit.layout.pieces(self.comm.rank)}
        unit.slots = {"shard": [], "whole": []}
        offset = 0
        for j, (shape, slots, _) in enumerate(unit.entries):
            if j < unit.n_sharded:
                pc = pieces.get(j)
                lo, numel = (pc.shard_lo, pc.hi - pc.lo) if pc else (0, 0)
                unit.slots["shard"].append((j, lo, numel, pc.lo if pc else 0))
                p = self._local_part(unit.originals[j](), unit.shard.detach()[lo:lo + numel].view(
                    unit.layout.local_shape(j, self.comm.rank)))
            else:
                numel = math.prod(shape)
                unit.slots["whole"].append((j, offset, numel, 0))
                p = self._local_part(unit.originals[j](),
                                     unit.whole.detach()[offset:offset + numel].view(shape))
                offset += numel
            p.full_shape = torch.Size(shape)
            unit.visible.append(p)
            unit.placeholders.append(torch.empty(shape, dtype=self.dtype, device="meta"))
            self._visible_ids.add(id(p))
            self._replaced[id(unit.originals[j]())] = (unit.originals[j], p)
            for mod, attr in slots:
                mod._parameters[attr] = p  # named_parameters() and the owner's state_dict() see it
                if j < unit.n_sharded and not getattr(mod, "_zero3_refuses_state_dict", False):
                    # it would save local parts
                    mod.register_state_dict_pre_hook(_refuse_shard_state_dict)
                    mod._zero3_refuses_state_dict = True

    @staticmethod
    def _local_part(original, view):
        """The Parameter that trains `view`: the user's ORIGINAL Parameter object, its .data now the
        view (FSDP1's use_orig_params), so an optimizer built before wrapping (nanoGPT's order)
        steps what trains, and its param groups keep the rules they were built by (p.dim() >= 2 on
        the full shape). A meta original (zero.Init) cannot take CPU data: a new Parameter stands in
        for it."""
        if original is None or original.is_meta:
            return nn.Parameter(view)
        original.data = view
        original.grad = None
        return original

    @torch.no_grad()
    def offload(self, grad_sink, fetch_shard=None, masters=None):
        """Plug in an optimizer tier off the device (FSDPOptimizer(offload=...), zero/tiers.py):
        each unit's reduced gradient goes to grad_sink(unit, part, flat fp32 grad) during backward
        instead of a device .grad; with fetch_shard(unit, shard) the shards live off the device and
        each all-gather copies one in; with masters(unit, part) -> fp32 host tensor the device
        shards are 16-bit copies of those masters (ZeRO-Offload's layout), which full state dicts
        read and write."""
        self.grad_sink = grad_sink
        self.fetch_shard = fetch_shard
        self.masters = masters

    def point_local_parts_at_shards(self):
        """Make every visible local part a view of its unit's shard (or whole) tensor again: after
        the shards' storage moved (offload_param nvme maps them into files), the views made by
        _expose would still hold the old storage, with stale values and its bytes."""
        for unit in self.units:
            places = iter(unit.slots["shard"] + unit.slots["whole"])
            for j, p in enumerate(unit.visible):
                _, start, numel, _ = next(places)
                source = unit.shard if j < unit.n_sharded else unit.whole
                p.data = source.detach()[start:start + numel].view(p.shape)

    def local_parameter(self, p: torch.Tensor) -> torch.Tensor:
        """The Parameter this model trains in place of `p`: p itself if it is one of
        named_parameters() (a local part, or a frozen one), or the local part that took the name of
        an original Parameter of the wrapped model (param groups built before wrapping map here)."""
        if id(p) in self._visible_ids or any(q is p for q in self.module.parameters()):
            return p
        ref, local = self._replaced.get(id(p), (None, None))
        if ref is None or ref() is not p:
            raise ValueError(f"a tensor of shape {tuple(p.shape)} is not a parameter of this FSDP "
                             "model")
        return local

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """The wrapped model's parameters under their ORIGINAL names (no "module." prefix, as
        FSDP2): each sharded one is this rank's local part (p.shape, p.numel() count only what this
        rank holds; p.full_shape is the full shape), frozen ones are whole. parameters() yields the
        same."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def _check_same_params(self):
        self.comm.check_replicated(self.module.named_parameters(), "FSDP")

    def _build_units(self, module, wrap, threshold):
        if wrap is None:
            listed = {id(c) for m in module.modules() if isinstance(m, nn.ModuleList) for c in m}
            wrap = lambda name, m: id(m) in listed  # noqa: E731
        elif isinstance(wrap, (type, tuple, list)):
            classes = tuple(wrap) if isinstance(wrap, (tuple, list)) else (wrap,)
            wrap = lambda name, m, c=classes: isinstance(m, c)  # noqa: E731
        names = [""] + [n for n, m in module.named_modules() if n and wrap(n, m)]
        found = {}  # id(param) -> [param, slots, fqns, enclosing units (outermost first)]
        for mname, m in module.named_modules(remove_duplicate=False):
            chain = [
                prefix
                for prefix in names
                if prefix == "" or mname == prefix or mname.startswith(prefix + ".")
            ]
            for attr, p in m._parameters.items():
                if p is None or not p.requires_grad:
                    continue
                e = found.setdefault(id(p), [p, [], [], chain])
                e[1].append((m, attr))
                e[2].append(f"{mname}.{attr}" if mname else attr)
                # common prefix: closest common unit
                e[3] = [a for a, b in zip(e[3], chain) if a == b]
        groups = {n: ([], []) for n in names}
        for p, slots, fqns, chain in found.values():
            groups[chain[-1]][p.numel() < threshold].append((p, slots, fqns))
        materialize = self._init.materialize if self._init is not None else None
        return [_Unit(n, module.get_submodule(n), *groups[n], self.comm, materialize,
                      SHARD_LAYOUTS[self.shard_layout])
                for n in names if any(groups[n])]

    # ------------------------------------------------------------------ gather / free
    @labelled("mz.fsdp.gather")  # a profiler range (comm/labels.py)
    def _start_gather(self, unit):
        """Launch unit's all-gather (async) into a new flat buffer; persistent part copied
        locally."""
        self.counters["gathers"] += 1
        self._event("gather", unit)
        src = unit.shard.detach() if unit.gathered_numel else None
        if src is not None and self.fetch_shard is not None:
            src = self.fetch_shard(unit, src)  # offload_param: the shard lives on the host
        if src is not None and src.dtype != self.dtype:  # (offloaded 16-bit shards need no cast)
            src = src.to(self.dtype)  # cast BEFORE communicating: half the bytes
            memory.transient.alloc(f"{self._tag}/{unit.name}/cast", src)
        buf = torch.empty(unit.gathered_numel + unit.persistent_numel, dtype=self.dtype,
                          device=self.comm.device)
        self._gather_shards(unit, buf, src)
        if unit.persistent_numel:
            buf[unit.gathered_numel:].copy_(unit.whole.detach())
        unit.buf, unit.src = buf, src  # MPI reads src until the gather completes: keep it alive

    def _gather_shards(self, unit, buf, src):
        """Start gathering every rank's shard `src` into buf; the handle goes to unit.work.
        (An extension point: ZeRO++ gathers int8 codes, or from its intra-node copy, here.)"""
        # pre-forward gather: start the all-gather of this unit.
        #   What must hold: on return, the all-gather of every rank's shard `src` into the first
        #   unit.gathered_numel elements of `buf` is IN FLIGHT, its handle in unit.work: _wait waits
        #   for it later, so that a prefetched unit's gather overlaps the compute before it. The
        #   rest of buf (persistent parameters, whole on every rank) is not gathered, and a unit
        #   with nothing to gather issues no collective. buf is recorded in the ledger under the
        #   unit's name, f"{self._tag}/{unit.name}", which _free (and ZeRO++'s subclass) use as
        #   well.
        #   API: memory.transient.alloc(name, tensor) records a live buffer. comm.all_gather(output,
        #   input, async_op=False): output holds comm.size x input's elements; with async_op=True it
        #   returns a handle with .wait().
        memory.transient.alloc(f"{self._tag}/{unit.name}", buf)
        if unit.gathered_numel:
            unit.work = self.comm.all_gather(buf[:unit.gathered_numel], src, async_op=True)

    def _wait(self, unit):
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
            # per_param: the gathered rank-major chunks into each parameter's place
            if unit.layout.reorders:
                gathered = unit.buf[:unit.gathered_numel]
                ordered = unit.layout.to_compute(gathered)
                # one more buffer, briefly
                memory.transient.alloc(f"{self._tag}/{unit.name}/reorder", ordered)
                gathered.copy_(ordered)
                memory.transient.free(f"{self._tag}/{unit.name}/reorder")
        if unit.src is not None and unit.shard.dtype != self.dtype:
            memory.transient.free(f"{self._tag}/{unit.name}/cast")
        unit.src = None

    def _free(self, unit):
        self._event("free", unit)
        self._saved_from.pop(unit.buf.untyped_storage().data_ptr(), None)
        # free the gathered unit.
        #   What must hold: afterwards no reference of FSDP's keeps the gathered buffer alive, and
        #   the ledger agrees: its entry f"{self._tag}/{unit.name}" is released
        #   (memory.transient.free(name)), and the unit no longer holds the buffer (unit.buf is how
        #   _need tells a gathered unit from one to gather). _post_forward then points the module's
        #   attributes at empty placeholders: the last references.
        memory.transient.free(f"{self._tag}/{unit.name}")
        unit.buf = None

    def _need(self, unit):
        """unit's full parameters, now: wait for its prefetch, or gather it here."""
        if unit.buf is None:
            self._start_gather(unit)
        elif unit.prefetched:
            self.counters["prefetch_hits"] += 1
        unit.prefetched = False
        self._wait(unit)

    def _prefetch(self, unit):
        if self.prefetch and unit is not None and unit.buf is None:
            self._start_gather(unit)
            unit.prefetched = True

    def _install(self, unit, full):
        """Point every owner's attribute at its view of `full` (None: at the full-shape meta
        placeholders, so code reading weight.shape between steps, like an extra_repr, still works).
        The attribute lives in the module's __dict__, in front of the local part in _parameters."""
        views = unit.split(full) if full is not None else unit.placeholders
        for j, ((_, slots, _), v) in enumerate(zip(unit.entries, views)):
            if full is not None and v.requires_grad:  # a gradient reaches it: used in this step
                v.register_hook(lambda grad, j=j: unit.used.add(j))
            for mod, attr in slots:
                object.__setattr__(mod, attr, v)

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        # BatchNorm's statistics stay rank 0's
        if self.broadcast_buffers and torch.is_grad_enabled():
            self.comm.broadcast_tensors(list(self.module.buffers()))
        for unit in self.units:  # a prefetch nobody consumed (a unit that did not run): drop it
            if unit.buf is not None:
                self._wait(unit)
                self._free(unit)
                unit.prefetched = False
        self._order, self._record, self.events = self._record or self._order, [], []
        self._t0 = time.perf_counter()
        self._forwarding = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        finally:
            self._forwarding = False

    def _pre_forward(self, unit):
        self._need(unit)
        self._saved_from[unit.buf.untyped_storage().data_ptr()] = unit
        self._install(unit, _Gather.apply(self, unit, unit.shard, unit.whole))
        # a recompute: the forward order and the next unit's prefetch are the forward's
        if not self._forwarding:
            return
        unit.visited = False
        self._record.append(unit)
        i = self._order.index(unit) if unit in self._order else len(self._order)
        self._prefetch(self._order[i + 1] if i + 1 < len(self._order) else None)

    def _post_forward(self, unit):
        # post-forward hook: free the unit as soon as its forward is done.
        #   What must hold: once a unit's forward is done, its full parameters take no memory until
        #   backward gathers them again. Two things keep the gathered buffer alive: FSDP's
        #   bookkeeping (self._free(unit) releases it) and the module's attributes, which are views
        #   of it. self._install(unit, full) points every attribute at its view of `full`, or, given
        #   None, at empty full-shape placeholders.
        self._free(unit)
        self._install(unit, None)

    # ------------------------------------------------------------------ backward
    def _pack(self, t):
        unit = (
            self._saved_from.get(t.untyped_storage().data_ptr())
            if t.device.type != "meta"
            else None
        )
        return t if unit is None or t.dtype != self.dtype else _ParamRef(unit, t)

    def _unpack(self, x):
        if not isinstance(x, _ParamRef):
            return x
        unit = x.unit
        if unit.buf is None or unit.work is not None or unit.prefetched:
            self._need(unit)
        if not unit.visited:  # unit's backward starts: prefetch the next unit backward will need
            unit.visited = True
            self._prefetch(
                next((v for v in reversed(self._record) if not v.visited and v.buf is None), None)
            )
        return unit.buf.as_strided(x.size, x.stride, x.offset)

    @torch.no_grad()
    def _reduce_grads(self, unit, g):
        """unit's whole flat gradient g: its average over ranks, added into the local parameters'
        .grad (_accumulate). Returns no gradient for autograd to add anywhere."""
        whole_grad = None
        memory.transient.alloc(f"{self._tag}/{unit.name}/grad", g)
        if unit.buf is not None:  # backward is done with unit's parameters
            self._wait(unit)
            self._free(unit)
        if self._dropping:  # another model's backward ran through this one (drop_gradients)
            memory.transient.free(f"{self._tag}/{unit.name}/grad")
            unit.used = set()
            return None, None
        self._event("reduce", unit)
        # per_param: each parameter's rows into the rank-major order reduce-scatter cuts
        if unit.layout.reorders:
            g = torch.cat([unit.layout.to_comm(g[:unit.gathered_numel]), g[unit.gathered_numel:]])
            # next to autograd's g, until freed below
            memory.transient.alloc(f"{self._tag}/{unit.name}/reorder", g)
        shard_grad = self._reduce_shard_grad(unit, g)
        # persistent parameters: whole everywhere, so all-reduce their gradients
        if unit.persistent_numel:
            whole_grad = g[unit.gathered_numel:].clone()
            self.comm.all_reduce(whole_grad, op="avg")
            whole_grad = whole_grad.float()
        memory.transient.free(f"{self._tag}/{unit.name}/grad")
        if unit.layout.reorders:
            memory.transient.free(f"{self._tag}/{unit.name}/reorder")
        for part, grad in (("shard", shard_grad), ("whole", whole_grad)):
            if grad is not None and self.grad_sink is not None:
                self.grad_sink(unit, part, grad)  # offload: straight to the host, no device .grad
                self._refuse_grads(unit, part)
            elif grad is not None:
                self._accumulate(unit, part, grad)
        unit.used = set()
        return None, None

    def _reduce_shard_grad(self, unit, g):
        """This rank's shard of the average over ranks of g (fp32), or None when nothing is sharded.
        (An extension point: ZeRO++'s quantized hierarchical reduce replaces it.)"""
        shard_grad = None
        # gradient reduce-scatter: each rank keeps the average of its own shard.
        #   What must hold: this rank gets the AVERAGE over the ranks of its own shard of the unit's
        #   gathered gradient g[:unit.gathered_numel] (unit.layout.shard_numel elements; shard r is
        #   rank r's, in rank order), returned as fp32 (the caller adds it into fp32 .grad); None
        #   when the unit gathers nothing. One collective, in g's dtype on the wire: a 16-bit
        #   gradient sent as fp32 would double the bytes.
        #   API: comm.reduce_scatter(output, input, op="sum", async_op=False): input holds comm.size
        #   x output's elements; op: "sum", "avg", "max", "min".
        if unit.gathered_numel:
            shard_grad = torch.empty(unit.layout.shard_numel, dtype=g.dtype, device=g.device)
            self.comm.reduce_scatter(shard_grad, g[:unit.gathered_numel], op="avg")
            shard_grad = shard_grad.float()  # no copy when already fp32
        return shard_grad

    def _accumulate(self, unit, part, grad):
        """Add this backward's averaged flat gradient into the local parameters' .grad, which are
        views of ONE flat buffer per unit part (as FSDP1's use_orig_params): the buffer lives as
        long as one of them does, so zero_grad(set_to_none=True) frees it. A parameter that got no
        gradient (not used here, and an exactly zero average: no rank used it) keeps .grad None,
        so optimizers skip it as torch's do."""
        flat = self.unit_grad(unit, part)
        if flat is None:
            flat = grad
            unit.grads[part] = weakref.ref(flat)
        else:
            flat.add_(grad)  # gradient accumulation: another backward before the step
        for j, offset, numel, _ in unit.slots[part]:
            p = unit.visible[j]
            # a 0-element local part used here gets an empty gradient, never None: per-parameter
            # loops (p.grad.norm(), comparing with DDP's gradients) run on every rank alike
            if p.grad is None and (
                j in unit.used or (numel and bool(grad[offset : offset + numel].any()))
            ):
                # a ShardedGrad: its norm is the full parameter's
                # (torch's clip line), as FSDP2's DTensors
                p.grad = sharded_grad(
                    flat[offset : offset + numel].view(p.shape),
                    self.comm if part == "shard" else None,
                    full=(
                        (lambda unit=unit, j=j: self._full_grad(unit, j))
                        if part == "shard"
                        else None
                    ),
                )

    _OFFLOADED = ("the gradients went to the offload tier during backward, so this .grad holds "
                  "none (torch's clip line would read a norm of 0 and clip nothing); clip with the "
                  "config's gradient_clipping, which the tier applies to its gradients")

    def _refuse_grads(self, unit, part):
        """Offload: each local parameter's .grad is a placeholder that refuses every use, naming
        where its gradient went; a None .grad would let torch's clip_grad_norm_ return 0
        silently."""
        for j, _, _, _ in unit.slots[part]:
            p = unit.visible[j]
            if p.grad is None:
                p.grad = placeholder_grad(p, None, None, None, None, "on the offload tier",
                                          refuse=self._OFFLOADED)

    @torch.no_grad()
    def _full_grad(self, unit, j: int) -> torch.Tensor:
        """Sharded entry j's whole averaged gradient (p.grad.full_tensor()): the unit's gradient
        shards all-gathered (equal pieces, whatever each rank holds of j), then j's slice."""
        full = torch.zeros(unit.gathered_numel, device=self.comm.device)
        flat = self.unit_grad(unit, "shard")
        self.comm.all_gather(
            full,
            flat.contiguous()
            if flat is not None
            else torch.zeros(unit.layout.shard_numel, device=self.comm.device),
        )
        a, n = unit.layout.offsets[j], unit.layout.numels[j]
        return unit.layout.to_compute(full)[a:a + n].view(unit.entries[j][0]).clone()

    def flat_parts(self):
        """This rank's flat tensors, unit by unit: (unit, part, tensor, numel, pieces), part "shard"
        (its piece of the unit's sharded buffer) or "whole" (the persistent parameters, kept whole);
        pieces [(name, lo, hi, offset)]: elements lo:hi of parameter `name`, at `offset` in
        tensor."""
        rank = self.comm.rank
        for u in self.units:
            first = [fqns[0] for _, _, fqns in u.entries]
            if u.shard is not None:
                yield u, "shard", u.shard, u.layout.shard_numel, [
                    (first[pc.index], pc.lo, pc.hi, pc.shard_lo) for pc in u.layout.pieces(rank)]
            if u.whole is not None:
                pieces, off = [], 0
                for (shape, _, _), name in zip(u.entries[u.n_sharded:], first[u.n_sharded:]):
                    pieces.append((name, 0, math.prod(shape), off))
                    off += math.prod(shape)
                yield u, "whole", u.whole, off, pieces

    def sharded_numel(self) -> int:
        """Elements all-gathered per forward (sharded + padding), over every unit: 0 when every
        parameter is below the persistence threshold and stays whole on every rank."""
        return sum(unit.gathered_numel for unit in self.units)

    def largest_tensor_numel(self) -> int:
        return max((n for unit in self.units for n in unit.sizes), default=0)

    def unit_grad(self, unit, part: str):
        """The flat fp32 gradient of unit's shard ("shard") or persistent part ("whole"), or None
        once no local parameter's .grad views it any more (zero_grad), even if someone else still
        holds it."""
        flat = unit.grads[part]() if part in unit.grads else None
        if flat is None or not any(
            unit.visible[j].grad is not None and unit.visible[j].grad._base is flat
            for j, _, numel, _ in unit.slots[part]
            if numel
        ):
            return None
        return flat

    # ------------------------------------------------------------------ torch DDP / FSDP idioms
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the GLOBAL norm, as torch FSDP's model.clip_grad_norm_ (a collective: every rank
        calls it). torch.nn.utils.clip_grad_norm_(model.parameters()) would see only this rank's
        local parts:
        ||g||^2 = sum over ranks of ||shard grads||^2 + ||persistent grads||^2 (those are equal
        everywhere)."""
        if norm_type != 2.0:
            raise ValueError(f"FSDP.clip_grad_norm_: norm_type must be 2.0, got {norm_type}")
        if self.grad_sink is not None:
            raise RuntimeError("FSDP.clip_grad_norm_: the gradients went to the offload tier "
                               "during backward; clip with the engine's gradient_clipping (or clip "
                               "the tier's gradients)")
        sharded = [self.unit_grad(unit, "shard") for unit in self.units if unit.shard is not None]
        whole = [self.unit_grad(unit, "whole") for unit in self.units if unit.whole is not None]
        return precision.clip_grad_norm_(sharded, max_norm, self.comm, replicated=whole)[0]

    @contextmanager
    def drop_gradients(self):
        """Backwards inside leave no gradient here: another model's loss backpropagates through this
        one (a GAN's generator through the discriminator), which needs the gathered parameters but
        not their gradients, which torch would leave in p.grad until the discriminator's
        zero_grad(). Every rank runs the same."""
        prev, self._dropping = self._dropping, True
        try:
            yield
        finally:
            self._dropping = prev

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's accumulation switch (nanoGPT sets it False on all but the last micro-batch).
        ZeRO-3 reduces every backward anyway (as DeepSpeed's stage 3): the averaged gradients add up
        to the average of the sum, so False is accepted and only costs bytes; it never changes the
        result."""
        return True

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool):
        pass  # see the getter: every backward reduces

    def _event(self, what, unit):
        self.events.append((time.perf_counter() - getattr(self, "_t0", 0.0), what, unit.name))

    # ------------------------------------------------------------------ state and memory
    @torch.no_grad()
    def gather_full_params(self) -> dict:
        """{original name: full fp32 tensor} on EVERY rank, in state_dict() order, tied weights
        under each name (one tensor). A collective: all ranks must call it."""
        full = {}
        for unit in self.units:
            flat = torch.zeros(unit.gathered_numel + unit.persistent_numel, device=self.comm.device)
            if unit.gathered_numel:
                source = (
                    unit.shard.detach() if self.masters is None else self.masters(unit, "shard")
                )
                self.comm.all_gather(flat[:unit.gathered_numel], source.to(self.comm.device))
                flat[:unit.gathered_numel] = unit.layout.to_compute(flat[:unit.gathered_numel])
            if unit.persistent_numel:
                flat[unit.gathered_numel:] = (unit.whole.detach() if self.masters is None
                                              else self.masters(unit, "whole"))
            for (_, _, names), v in zip(unit.entries, unit.split(flat)):
                full.update(dict.fromkeys(names, v.clone()))
        full.update((n, p.detach().clone()) for n,
                    p in self.module.named_parameters(remove_duplicate=False)
                    if id(p) not in self._visible_ids)  # frozen: whole
        return {k: full[k] for k in self._keys if k in full}

    def state_dict(self, *args, **kwargs):
        """Full parameters and buffers under the original names (a collective, like
        gather_full_params)."""
        full, buffers = self.gather_full_params(), dict(self.module.named_buffers())
        return {k: full[k] if k in full else buffers[k].detach().clone() for k in self._keys}

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True):
        """From a full state dict (original names): each rank keeps its slice. No communication."""
        if strict and sorted(state_dict) != sorted(self._keys):
            raise KeyError("FSDP.load_state_dict: keys differ; missing "
                           f"{sorted(set(self._keys) - set(state_dict))}, unexpected "
                           f"{sorted(set(state_dict) - set(self._keys))}")
        for unit in self.units:
            unit.load([state_dict[names[0]] for _, _, names in unit.entries], self.comm.rank)
            # 16-bit device shards: the exact fp32 values go to the host masters
            if self.masters is not None:
                unit.load([state_dict[names[0]] for _, _, names in unit.entries], self.comm.rank,
                          self.masters(unit, "shard"), self.masters(unit, "whole"))
        for name, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
            if id(t) not in self._visible_ids:  # frozen parameters and buffers
                t.copy_(state_dict[name])

    def memory_tensors(self):
        """For memory.measure: shards (fp32 master copy when computing in 16 bits), persistent
        and frozen parameters, shard gradients, buffers, and any gathered buffer still held."""
        for unit in self.units:
            for p in (unit.shard, unit.whole):  # fp32 under a 16-bit compute_dtype: the master copy
                if p is not None:
                    yield "parameters" if p.dtype == self.dtype else "master_params", p, None
            for p in unit.visible:  # their .grads are views of the unit's flat gradients
                if p.grad is not None and not is_placeholder(p.grad):  # (offload's hold no values)
                    yield "gradients", p.grad, None
            if unit.buf is not None:  # gathered and not freed: parameter memory this rank holds
                yield "parameters", unit.buf, None
        for p in self.module.parameters():  # frozen: whole on every rank
            if id(p) not in self._visible_ids:
                yield "parameters", p, None
        for b in self.module.buffers():
            yield "buffers", b, None

    def extra_repr(self) -> str:
        return (
            f"world={self.comm.size}, compute_dtype={self.compute_dtype}, "
            f"prefetch={self.prefetch}, shard_layout={self.shard_layout}, units="
            + ", ".join(
                f"{unit.name}({unit.layout.numel}+{unit.layout.padding}pad+"
                f"{unit.persistent_numel}whole)"
                for unit in self.units
            )
        )


ZeRO3 = FSDP


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(6, globals())
