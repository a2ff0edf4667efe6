# Lab 06: ZeRO-3 / FSDP: gather and free hooks
# GENERATED from minizero/zero/fsdp.py by `make labs`. Edit nothing: this is the reference solution.
#   run:   mpirun -n 4 python solutions/lab06_zero3.py
#   check: python -m minizero grade --lab 6 --impl solutions    (or: pytest -m lab6 --impl solutions)
"""minizero.zero.fsdp: ZeRO stage 3 / FSDP. Parameters are sharded too, gathered a unit at a time.

ZeRO (Rajbhandari et al. 2020, Sec. 5.3, P_os+g+p): each of N ranks keeps 1/N of the parameters,
gradients AND optimizer state, (2 + 2 + K)Ψ/N bytes instead of DDP's (2 + 2 + K)Ψ; a layer's full
weights exist only while it computes. The price (Sec. 7.2.2) is one more all-gather per step:
all-gather (forward) + all-gather (backward) + reduce-scatter = 3(N-1)/N·Ψ·b bytes sent per rank,
1.5x DDP's all-reduce 2(N-1)/N·Ψ·b.

    model = FSDP(TinyGPT(cfg))                        # the same seed on every rank
    opt = torch.optim.Adam(model.parameters(), lr)    # sees this rank's fp32 shards only
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

A step, for unit unit: the forward pre-hook all-gathers unit's shards into a fresh flat buffer (or
waits for its prefetch) and points the module's parameter attributes at views of it; the
post-hook frees it; backward gathers unit again when it first needs one of unit's weights; when unit's
gradient is complete it is reduce-scattered (avg) into unit.shard.grad and unit is freed. How, with
public torch 2.13 API, the same on CPU and CUDA:
  * the buffer enters autograd through _Gather, a Function of the shard whose backward is the
    transpose of an all-gather, a reduce-scatter. The views are split()s of its output, so unit's
    gradients meet in ONE node, run once when complete (unused parameters and padding get
    zeros from SplitBackward), and autograd accumulates its result into unit.shard.grad;
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

Rules: every rank builds the same model (debug=True checks) and runs the same units in the same
order, so all issue the same collectives, also for a parameter unused in a step (a zero slice
of its unit's gradient). A unit whose weights no backward op reads (only biases) is not gathered
again: fewer bytes than 3(N-1)/N·Ψ. Buffers stay replicated (rank 0's, broadcast at construction
like DDP). Between steps the module's sharded attributes are empty: use gather_full_params(),
state_dict() (collectives) and load_state_dict().
"""
from __future__ import annotations

import itertools
import time

import torch
import torch.nn as nn

from minizero import comm as comm_mod
from minizero import memory
from minizero.zero.flat_layout import FlatLayout
from minizero.zero.init import built_with_init

_IDS = itertools.count()


class _ParamRef:
    """Saved for backward instead of a view of a gathered buffer: which unit, which view."""
    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit, t):
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()


class _Gather(torch.autograd.Function):
    """Identity on the already gathered unit.buf in forward; reduce-scatter in backward."""

    @staticmethod
    def forward(ctx, fsdp, unit, shard, whole):
        ctx.fsdp, ctx.unit = fsdp, unit
        return unit.buf

    @staticmethod
    def backward(ctx, g):
        return (None, None) + ctx.fsdp._reduce_grads(ctx.unit, g.contiguous())


class _Unit:
    """One flat parameter. entries: (shape, [(owner module, attr)], [names]); the first n_sharded
    are sharded, the rest persistent. Its gathered buffer: [sharded | padding | persistent]."""

    def __init__(self, name, module, sharded, persistent, comm, materialize=None):
        self.name = name or "root"       # the wrapped module's name
        self.module = module             # its hooks gather and free this unit
        self.n_sharded = len(sharded)    # entries[:n_sharded] are sharded, the rest persistent
        # shapes only: holding the original Parameters would keep the full model alive
        self.entries = [(p.shape, slots, names) for p, slots, names in sharded + persistent]
        self.layout = FlatLayout([p.shape for p, _, _ in sharded], comm.size)
        self.gathered_numel = self.layout.padded_numel  # elements all-gathered (sharded + padding)
        self.persistent_numel = sum(p.numel() for p, _, _ in persistent)  # elements kept whole on every rank
        self.sizes = self.layout.numels + [self.layout.padding] + [p.numel() for p, _, _ in persistent]
        self.shard = nn.Parameter(torch.empty(self.layout.shard_numel, device=comm.device)) if self.gathered_numel else None
        self.whole = nn.Parameter(torch.empty(self.persistent_numel, device=comm.device)) if self.persistent_numel else None
        tensors = [p for p, _, _ in sharded + persistent]
        self.load([materialize(t) for t in tensors] if materialize else tensors, comm.rank)  # zero.Init: one unit
        self.buf = None          # the gathered buffer, while it exists
        self.work = None         # the in-flight all-gather into it
        self.src = None          # the shard cast to compute_dtype, while its gather is in flight
        self.prefetched = False  # gathered ahead of need in this step
        self.visited = False     # its backward gather is done in this step

    @torch.no_grad()
    def load(self, tensors, rank):
        """Take this rank's slice of the full tensors (in entries order)."""
        if self.gathered_numel:
            self.shard.copy_(self.layout.shard(self.layout.flatten(tensors[:self.n_sharded], torch.float32,
                                                                   self.shard.device), rank))
        if self.persistent_numel:
            self.whole.copy_(torch.cat([t.reshape(-1).float() for t in tensors[self.n_sharded:]]))

    def split(self, flat):
        """Views of a full flat buffer, one per entry, shaped like the parameters."""
        views = list(flat.split(self.sizes))
        del views[self.n_sharded]  # the padding
        return [v.view(shape) for v, (shape, _, _) in zip(views, self.entries)]


class FSDP(nn.Module):
    def __init__(self, module: nn.Module, comm: comm_mod.Communicator | None = None, compute_dtype=None,
                 prefetch: bool = True, persistence_threshold: int = 0, wrap=None, debug: bool | None = None):
        super().__init__()
        if isinstance(module, FSDP) or any(getattr(m, "_zero3_wrapped", False) for m in module.modules()):
            raise ValueError("FSDP: this module is already wrapped by FSDP (its parameters are flat shards "
                             "now). Wrap the plain module once; use `wrap=` to choose the inner units.")
        if compute_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"compute_dtype must be None, torch.bfloat16 or torch.float16, got {compute_dtype}")
        self.module = module  # the wrapped model (torch's convention: .module)
        self.comm = comm or comm_mod.get()
        self.compute_dtype = None if compute_dtype == torch.float32 else compute_dtype  # None: fp32, no cast
        self.prefetch = prefetch  # gather the next unit while this one computes
        self.dtype = compute_dtype or torch.float32  # what the units compute and reduce in
        self.debug = self.comm.debug if debug is None else debug
        self._tag = f"zero3#{next(_IDS)}"
        self._empty = torch.empty(0, dtype=self.dtype, device=self.comm.device)  # a freed attribute
        self._init = built_with_init(module)  # built under zero.Init: materialized here, one unit at a time
        if self._init is not None:
            self._init.materialize_replicated(module)  # buffers and frozen parameters: small, whole everywhere
        elif self.debug and self.comm.size > 1:
            self._check_same_params()
        with torch.no_grad():  # buffers: replicated, rank 0's win (as in DDP)
            for b in module.buffers():
                self.comm.broadcast(b.data if b.is_contiguous() else b.data.contiguous(), src=0)
        # state_dict() order: parameter names (tied ones under every name) and buffers
        self._keys = list(module.state_dict().keys())
        self.units = self._build_units(module, wrap, persistence_threshold)
        for i, unit in enumerate(self.units):
            for name, p in (("shard", unit.shard), ("whole", unit.whole)):
                if p is not None:
                    self.register_parameter(f"{name}_{i}", p)
            for _, slots, _ in unit.entries:  # the originals leave the module: plain attributes now
                for mod, attr in slots:
                    mod._parameters.pop(attr, None)
            self._install(unit, None)
            unit.module.register_forward_pre_hook(lambda m, args, unit=unit: self._pre_forward(unit))
            unit.module.register_forward_hook(lambda m, args, out, unit=unit: self._post_forward(unit))
        module._zero3_wrapped = True
        self._saved_from = {}           # storage ptr of a gathered forward buffer -> unit
        self._order = self.units        # forward order of the units: the last forward's
        self._record = []               # ... and this forward's, as it happens
        self.counters = {"gathers": 0, "prefetch_hits": 0}
        self.events = []                # this step's schedule: (seconds, what, unit)
        self.fetch_shard = None         # offload_param: fn(unit, shard) -> a device copy, before each all-gather

    # ------------------------------------------------------------------ construction
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
            chain = [prefix for prefix in names if prefix == "" or mname == prefix or mname.startswith(prefix + ".")]
            for attr, p in m._parameters.items():
                if p is None or not p.requires_grad:
                    continue
                e = found.setdefault(id(p), [p, [], [], chain])
                e[1].append((m, attr))
                e[2].append(f"{mname}.{attr}" if mname else attr)
                e[3] = [a for a, b in zip(e[3], chain) if a == b]  # common prefix: closest common unit
        groups = {n: ([], []) for n in names}
        for p, slots, fqns, chain in found.values():
            groups[chain[-1]][p.numel() < threshold].append((p, slots, fqns))
        materialize = self._init.materialize if self._init is not None else None
        return [_Unit(n, module.get_submodule(n), *groups[n], self.comm, materialize) for n in names if any(groups[n])]

    # ------------------------------------------------------------------ gather / free
    def _start_gather(self, unit):
        """Launch unit's all-gather (async) into a new flat buffer; persistent part copied locally."""
        self.counters["gathers"] += 1
        self._event("gather", unit)
        src = unit.shard.detach() if unit.gathered_numel else None
        if src is not None and self.fetch_shard is not None:
            src = self.fetch_shard(unit, src)  # offload_param: the shard lives on the host
        if src is not None and self.compute_dtype is not None:
            src = src.to(self.dtype)  # cast BEFORE communicating: half the bytes
            memory.transient.alloc(f"{self._tag}/{unit.name}/cast", src)
        buf = torch.empty(unit.gathered_numel + unit.persistent_numel, dtype=self.dtype, device=self.comm.device)
        # pre-forward gather: start the all-gather of this unit.
        #   Record `buf` with memory.transient.alloc(f"{self._tag}/{unit.name}", buf).
        #   When unit.gathered_numel > 0: all-gather this rank's shard `src` into
        #     buf[:unit.gathered_numel] with async_op=True, and keep the handle in unit.work
        #     (the wait comes later, in _wait).
        memory.transient.alloc(f"{self._tag}/{unit.name}", buf)
        if unit.gathered_numel:
            unit.work = self.comm.all_gather(buf[:unit.gathered_numel], src, async_op=True)
        if unit.persistent_numel:
            buf[unit.gathered_numel:].copy_(unit.whole.detach())
        unit.buf, unit.src = buf, src  # MPI reads src until the gather completes: keep it alive

    def _wait(self, unit):
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        if unit.src is not None and self.compute_dtype is not None:
            memory.transient.free(f"{self._tag}/{unit.name}/cast")
        unit.src = None

    def _free(self, unit):
        self._event("free", unit)
        self._saved_from.pop(unit.buf.untyped_storage().data_ptr(), None)
        # free the gathered unit.
        #   Tell memory.transient that f"{self._tag}/{unit.name}" is freed, and drop this unit's
        #   own reference to the buffer (unit.buf = None). _post_forward then points the module's
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
        """Point every owner's attribute at its view of `full` (None: at an empty placeholder)."""
        views = unit.split(full) if full is not None else [self._empty] * len(unit.entries)
        for (_, slots, _), v in zip(unit.entries, views):
            for mod, attr in slots:
                object.__setattr__(mod, attr, v)

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        for unit in self.units:  # a prefetch nobody consumed (a unit that did not run): drop it
            if unit.buf is not None:
                self._wait(unit)
                self._free(unit)
                unit.prefetched = False
        self._order, self._record, self.events = self._record or self._order, [], []
        self._t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    def _pre_forward(self, unit):
        self._need(unit)
        self._saved_from[unit.buf.untyped_storage().data_ptr()] = unit
        self._install(unit, _Gather.apply(self, unit, unit.shard, unit.whole))
        unit.visited = False
        self._record.append(unit)
        i = self._order.index(unit) if unit in self._order else len(self._order)
        self._prefetch(self._order[i + 1] if i + 1 < len(self._order) else None)

    def _post_forward(self, unit):
        # post-forward hook: free the unit as soon as its forward is done.
        #   Free its gathered buffer with self._free(unit), then point the module's attributes at
        #   the empty placeholders with self._install(unit, None), or they keep the buffer alive.
        self._free(unit)
        self._install(unit, None)

    # ------------------------------------------------------------------ backward
    def _pack(self, t):
        unit = self._saved_from.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        return t if unit is None or t.dtype != self.dtype else _ParamRef(unit, t)

    def _unpack(self, x):
        if not isinstance(x, _ParamRef):
            return x
        unit = x.unit
        if unit.buf is None or unit.work is not None or unit.prefetched:
            self._need(unit)
        if not unit.visited:  # unit's backward starts: prefetch the next unit backward will need
            unit.visited = True
            self._prefetch(next((v for v in reversed(self._record) if not v.visited and v.buf is None), None))
        return unit.buf.as_strided(x.size, x.stride, x.offset)

    @torch.no_grad()
    def _reduce_grads(self, unit, g):
        """unit's whole flat gradient g: its average over ranks, as (shard grad, whole grad)."""
        shard_grad = whole_grad = None
        memory.transient.alloc(f"{self._tag}/{unit.name}/grad", g)
        if unit.buf is not None:  # backward is done with unit's parameters
            self._wait(unit)
            self._free(unit)
        self._event("reduce", unit)
        # gradient reduce-scatter: each rank keeps the average of its own shard.
        #   When unit.gathered_numel > 0: shard_grad = a new tensor of unit.layout.shard_numel
        #     elements in g's dtype; reduce-scatter (op="avg") g[:unit.gathered_numel] into it.
        #   Return it as fp32 (autograd adds it into unit.shard.grad).
        if unit.gathered_numel:
            shard_grad = torch.empty(unit.layout.shard_numel, dtype=g.dtype, device=g.device)
            self.comm.reduce_scatter(shard_grad, g[:unit.gathered_numel], op="avg")
            shard_grad = shard_grad.float()  # no copy when already fp32
        if unit.persistent_numel:  # persistent parameters: whole everywhere, so all-reduce their gradients
            whole_grad = g[unit.gathered_numel:].clone()
            self.comm.all_reduce(whole_grad, op="avg")
            whole_grad = whole_grad.float()
        memory.transient.free(f"{self._tag}/{unit.name}/grad")
        return shard_grad, whole_grad

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
                self.comm.all_gather(flat[:unit.gathered_numel], unit.shard.detach())
            if unit.persistent_numel:
                flat[unit.gathered_numel:] = unit.whole.detach()
            for (_, _, names), v in zip(unit.entries, unit.split(flat)):
                full.update(dict.fromkeys(names, v.clone()))
        full.update((n, p.detach().clone()) for n, p in self.module.named_parameters(remove_duplicate=False))
        return {k: full[k] for k in self._keys if k in full}

    def state_dict(self, *args, **kwargs):
        """Full parameters and buffers under the original names (a collective, like gather_full_params)."""
        full, buffers = self.gather_full_params(), dict(self.module.named_buffers())
        return {k: full[k] if k in full else buffers[k].detach().clone() for k in self._keys}

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True):
        """From a full state dict (original names): each rank keeps its slice. No communication."""
        if strict and sorted(state_dict) != sorted(self._keys):
            raise KeyError(f"FSDP.load_state_dict: keys differ; missing {sorted(set(self._keys) - set(state_dict))}, "
                           f"unexpected {sorted(set(state_dict) - set(self._keys))}")
        for unit in self.units:
            unit.load([state_dict[names[0]] for _, _, names in unit.entries], self.comm.rank)
        for name, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
            t.copy_(state_dict[name])

    def memory_tensors(self):
        """For memory.measure: shards (fp32 master copy when computing in 16 bits), persistent
        and frozen parameters, shard gradients, buffers, and any gathered buffer still held."""
        cat = "parameters" if self.compute_dtype is None else "master_params"
        for unit in self.units:
            for p in (unit.shard, unit.whole):
                if p is not None:
                    yield cat, p, None
                    if p.grad is not None:
                        yield "gradients", p.grad, None
            if unit.buf is not None:  # gathered and not freed: parameter memory this rank holds
                yield "parameters", unit.buf, None
        for p in self.module.parameters():  # frozen: whole on every rank
            yield "parameters", p, None
        for b in self.module.buffers():
            yield "buffers", b, None

    def extra_repr(self) -> str:
        return (f"world={self.comm.size}, compute_dtype={self.compute_dtype}, prefetch={self.prefetch}, units="
                + ", ".join(f"{unit.name}({unit.layout.numel}+{unit.layout.padding}pad+{unit.persistent_numel}whole)" for unit in self.units))


ZeRO3 = FSDP


if __name__ == "__main__":
    from minizero.autograde import lab_main
    lab_main(6, globals())
