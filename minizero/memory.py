"""Memory: what the formulas predict, and what a rank really holds.

Two halves that never look at each other, so that one can check the other:

* the **estimator** evaluates the model-state formulas of the ZeRO paper
  (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", Sec. 3 and 5, Table 1), plus inference weights and the
  Megatron activation estimate (with tensor and sequence parallelism);
* the **ledger** walks real tensors, de-duplicates their storages and adds up the
  bytes by category and by where they live; `SavedTensors` does the same for the
  activations autograd saves during a forward. Neither calls the estimator.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Integral
from typing import NamedTuple

import torch

# --------------------------------------------------------------------- estimator

LOCATIONS = ("device", "host", "disk")  # where a byte can live, in the estimator and the ledger


STATE_CATEGORIES = ("parameters", "master_params", "gradients", "optimizer_state")  # model states


@dataclass(frozen=True)
class Estimate:
    """Model-state bytes per device (ideal: no padding, no fragmentation): estimate_by_location's
    {category: {location: bytes}} added up, so the two can never disagree.

    `optimizer_state` is the paper's K·Ψ term: for mixed-precision Adam (K=12) it is the fp32 master
    copy (4Ψ) + momentum (4Ψ) + variance (4Ψ); the ledger splits the master copy out as
    "master_params" (so does `by_location`), so compare with master_params + optimizer_state.
    """
    by_location: dict

    def _sum(self, categories, locations=LOCATIONS):
        return sum(self.by_location[c][loc] for c in categories for loc in locations)

    parameters = property(lambda self: self._sum(("parameters",)))
    gradients = property(lambda self: self._sum(("gradients",)))
    optimizer_state = property(lambda self: self._sum(("master_params", "optimizer_state")))
    total = property(lambda self: self._sum(STATE_CATEGORIES))
    device = property(lambda self: self._sum(STATE_CATEGORIES, ("device",)))
    host = property(lambda self: self._sum(STATE_CATEGORIES, ("host",)))
    disk = property(lambda self: self._sum(STATE_CATEGORIES, ("disk",)))


def estimate(num_params, world_size=1, stage=0, k=12, param_bytes=2, grad_bytes=2,
             offload_optimizer=False, offload_param=False, hpz_partition_size=None) -> Estimate:
    """Per-device model states for ZeRO stage 0 (plain DDP) to 3, after the ZeRO paper: the sum over
    locations of estimate_by_location (one function computes both).

    With Ψ params, N ranks, mixed precision (2-byte params and grads) and K bytes of
    optimizer state per parameter:
        stage 0: 2Ψ + 2Ψ + KΨ       stage 2: 2Ψ + (2+K)Ψ/N
        stage 1: 2Ψ + 2Ψ + KΨ/N     stage 3: (2+2+K)Ψ/N
    Other precisions by the byte widths, e.g. fp32 Adam without master weights:
    param_bytes=4, grad_bytes=4, k=8. K is split as estimate_by_location wants it: a 4-byte fp32
    master when the parameters are narrower than 4 bytes, the rest elementwise state.

    offload_optimizer=True (ZeRO-Offload, "cpu") and offload_param=True (ZeRO-Infinity's parameters,
    "cpu", stage 3): where each term lives is estimate_by_location's docstring; .device / .host
    split it. hpz_partition_size (ZeRO++ hpZ, stage 3 only): a secondary copy of the 16-bit
    parameters sharded within groups of that size adds param_bytes·Ψ/hpz. None or 1
    means off, as in DeepSpeed (a "partition" of size 1 would be a full replica).
    """
    master = min(4, k) if param_bytes < 4 else 0
    return Estimate(estimate_by_location(num_params, world_size, stage, param_bytes, grad_bytes,
                                         k - master, "cpu" if offload_optimizer else "none",
                                         "cpu" if offload_param else "none",
                                         hpz_partition_size=hpz_partition_size,
                                         master_bytes=master))


def offload_stage_error(
    stage: int, optimizer_device: str = "none", param_device: str = "none"
) -> str | None:
    """The ZeRO stages each offload tier needs (DeepSpeed's rules), or None when they fit. The one
    copy of them: the config (runtime/config.py), the planner and the estimator below all ask
    here."""
    if optimizer_device != "none" and stage == 0:
        return (f"offload_optimizer.device={optimizer_device!r} needs ZeRO stage 1, 2 or 3: stage "
                "0 keeps every state replicated, there is no shard to offload (ZeRO-Offload builds "
                "on stage 2)")
    if optimizer_device == "nvme" and stage != 3:
        return ("offload_optimizer.device='nvme' (ZeRO-Infinity) needs stage 3, as in DeepSpeed; "
                f"use device 'cpu' at stage {stage}")
    if param_device != "none" and stage != 3:
        return "offload_param needs stage 3 (only stage 3 partitions parameters)"
    return None


def estimate_by_location(num_params, world_size=1, stage=0, param_bytes=2, grad_bytes=2,
                         state_bytes=8, offload_optimizer="none", offload_param="none",
                         hpz_partition_size=None, master_bytes=None) -> dict[str, dict[str, float]]:
    """Model states per rank as {category: {location: bytes}}, the ledger's own layout, for ZeRO
    (Rajbhandari et al. 2020), ZeRO-Offload (Ren et al. 2021) and ZeRO-Infinity (Rajbhandari et al.
    2021).

    With S = Ψ/N (stage >= 1; Ψ at stage 0), b_p, b_g the device widths (2 in fp16), state_bytes =
    the optimizer's elementwise state (Adam m + v: 8; SGD momentum: 4) and master_bytes the fp32
    master (default: 4 when b_p < 4, else 0 on the device; always 4 on the host, where it is a
    separate copy):
        no offload     device: params b_p·Ψ (stage 3: b_p·S), grads b_g·Ψ (stage 2, 3: b_g·S),
                       master master_bytes·S, state state_bytes·S. (minizero's ZeRO-3 keeps fp32
                       shards and fp32 shard gradients: pass param_bytes=4, grad_bytes=4 there.)
        offload cpu    host: master 4·S + fp32 grads 4·S + state state_bytes·S. The device keeps
                       only the b_p-byte parameters (stage 3: the shard): stage 2 and 3 send each
                       bucket's reduced gradient to the host during backward, as ZeRO-Offload does,
                       so no gradient stays on the device between steps; minizero's stage 1 reduces
                       at the step, so it keeps its full b_g·Ψ gradients (stage 1 in DeepSpeed
                       shares stage 2's code)
        offload nvme   as cpu, but master and state on "disk" (stage 3 only); minizero's disk tier
                       keeps fp32 shards on the device (pass param_bytes=4)
        offload_param  cpu (stage 3): the parameter shards on the host; nvme: on disk
        hpZ            (stage 3) a secondary b_p-byte copy sharded over hpz_partition_size ranks:
                       b_p·Ψ/hpz
    Not model states, and not in here: the transient buffers. The ledger's transient_peak reports
    them by name: ZeRO-2's gradient buckets (at most two of bucket_numel·b_g bytes: one filling, one
    reducing), ZeRO-3's gathered units (this one and the prefetched one) and each unit's gradient.
    """
    hpz = hpz_partition_size or 1
    for bad, why in ((num_params < 0 or world_size < 1, "need num_params >= 0, world_size >= 1"),
                     (stage not in (0, 1, 2, 3), f"stage must be 0..3, got {stage}"),
                     (hpz > 1 and stage != 3, "hpz_partition_size needs stage 3"),
                     (hpz > world_size, f"hpz_partition_size {hpz} > world_size {world_size}"),
                     (stage in (0, 1, 2, 3),
                      offload_stage_error(stage, offload_optimizer, offload_param))):
        if bad and why:
            raise ValueError(why)
    n, psi = world_size, num_params
    shard = psi / n if stage >= 1 else psi
    out = {c: {loc: 0.0 for loc in LOCATIONS} for c in STATE_CATEGORIES}
    where_params = {"cpu": "host", "nvme": "disk"}.get(offload_param, "device")
    out["parameters"][where_params] = param_bytes * (shard if stage == 3 else psi)
    if hpz > 1:
        out["parameters"]["device"] += param_bytes * psi / hpz
    if offload_optimizer == "none":
        out["gradients"]["device"] = grad_bytes * (shard if stage >= 2 else psi)
        out["master_params"]["device"] = (
            (4 if param_bytes < 4 else 0) * shard if master_bytes is None else master_bytes * shard
        )
        out["optimizer_state"]["device"] = state_bytes * shard
        return out
    where = "disk" if offload_optimizer == "nvme" else "host"
    out["gradients"]["device"] = grad_bytes * psi if stage == 1 else 0.0
    out["gradients"]["host"] = 4 * shard
    out["master_params"][where] = (4 if master_bytes is None else master_bytes) * shard
    out["optimizer_state"][where] = state_bytes * shard
    return out


_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 0.5}


def inference_bytes(num_params, dtype) -> float:
    """Bytes of the weights alone (no KV cache, no activations) at a given precision."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    return num_params * _DTYPE_BYTES[dtype]


class Table1Row(NamedTuple):
    n: int          # data-parallel degree
    os: float       # GB per device with ZeRO stage 1 (P_os)
    os_g: float     # stage 2 (P_os+g)
    os_g_p: float   # stage 3 (P_os+g+p)


# The 7.5B column of Table 1 as printed in the paper (rounded there), for comparison.
PAPER_TABLE1 = {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5),
                64: (31.4, 16.6, 1.88), 256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)}


def zero_paper_table1(num_params=7.5e9, k=12) -> list[Table1Row]:
    """Table 1 of the ZeRO paper, computed: GB (1e9 bytes) per device for each N."""
    return [Table1Row(n, *(estimate(num_params, n, stage, k).total / 1e9 for stage in (1, 2, 3)))
            for n in (1, 4, 16, 64, 256, 1024)]


def activation_bytes(
    batch,
    seq,
    hidden,
    layers,
    heads,
    bytes_per=2,
    checkpointing=False,
    tensor_parallel=1,
    sequence_parallel=False,
    dropout=True,
    attention_scores=None,
) -> float:
    """Activation bytes a GPT-style transformer keeps for backward, per rank.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    Sec. 4.1-4.2, per layer with 16-bit activations and 1-byte dropout masks:
        no parallelism   s·b·h·(34 + 5·a·s/h)
        t-way tensor p.  s·b·h·(10 + 24/t + 5·a·s/(h·t))
        TP + sequence p. s·b·h/t·(34 + 5·a·s/h)
    The terms, in units of s·b·h elements of bytes_per = w bytes: the two LayerNorm inputs and
    the attention and MLP inputs (4w, whole on every rank under TP, split by SP), two dropout
    masks (2 × 1 byte, likewise); q, k, v, the attention projection's input, the GeLU's input and
    the second linear's input (12w, split by TP); per head a·s²·b: the softmax output (w), its
    dropout mask (1) and the dropout output (w), split by TP. For w = 2: 34, 10 + 24/t, 5·a·s/h.
    dropout=False drops the masks, and attention-times-V keeps the softmax output itself: w·a·s²·b.
    With full activation checkpointing (checkpointing=True or "full") only each layer's input is
    kept: w·s·b·h per layer (÷t with SP; plus one layer recomputed during backward, not counted).
    Selective recomputation (checkpointing="selective", Sec. 5) recomputes the core attention and
    keeps the rest: the a·s² term goes, s·b·h·34 per layer for w = 2 with dropout (s·b·h·16·w
    without). Embeddings and the LM head are ignored, as are the LayerNorm statistics (see tensor's
    lesson for what they add).
    attention_scores: the score elements per sequence a layer keeps, a·s² by default; block-sparse
    attention keeps only its layout's kept blocks, nnz·block² (minizero.sparse.score_bytes /
    bytes_per).
    """
    s, b, h, a, t = seq, batch, hidden, heads, tensor_parallel
    split_by_sp = t if sequence_parallel else 1
    if checkpointing not in (False, True, "full", "selective"):
        raise ValueError(f"checkpointing={checkpointing!r}: expected False, True, 'full' or "
                         "'selective'")
    if checkpointing is True or checkpointing == "full":
        return layers * bytes_per * s * b * h / split_by_sp
    mask = 1 if dropout else 0
    whole = s * b * h * (4 * bytes_per + 2 * mask)  # what TP leaves whole on every rank, SP splits
    scores = a * s * s if attention_scores is None else attention_scores
    split = 12 * bytes_per * s * b * h
    # the softmax output, its dropout mask and output: recomputed when selective
    if checkpointing != "selective":
        split += scores * b * (bytes_per + mask * (bytes_per + 1))
    return layers * (whole / split_by_sp + split / t)


# ------------------------------------------------------------------------ ledger

# Order = precedence: a storage reachable from two places is counted once, under the
# first category in this order (fp32 training where the "master copy" IS the parameters;
# a flat buffer that a wrapper reports both as parameters and as gradients).
CATEGORIES = ("parameters", "master_params", "gradients", "optimizer_state", "buffers")


def _nbytes(x) -> int:
    if isinstance(x, Integral) and not isinstance(x, bool):
        return int(x)
    if torch.is_tensor(x):
        # The whole storage: a view into a flat buffer holds the flat buffer alive.
        return 0 if x.device.type == "meta" else x.untyped_storage().nbytes()
    raise TypeError(f"expected a tensor or an int number of bytes, got {type(x).__name__}")


class Transient:
    """High-water mark of short-lived buffers (gathered params, buckets, comm scratch).

    These never show up in a snapshot of the model and optimizer, yet they decide
    whether a step fits, so the code that allocates them reports them here by name.
    Thread-safe because offload I/O threads allocate too.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        """Forget everything, live buffers included (call between experiments)."""
        with self._lock:
            self._live: dict[str, int] = {}
            self.current = self.peak = 0

    def alloc(self, name, tensor_or_nbytes):
        """Record a live buffer. Re-using a live name replaces its size (a resized buffer)."""
        n = _nbytes(tensor_or_nbytes)
        with self._lock:
            self.current += n - self._live.get(name, 0)
            self._live[name] = n
            self.peak = max(self.peak, self.current)

    def free(self, name):
        with self._lock:
            if name not in self._live:
                raise KeyError(f"transient.free({name!r}): no live buffer of that name")
            self.current -= self._live.pop(name)

    @contextmanager
    def hold(self, name, tensor_or_nbytes):
        self.alloc(name, tensor_or_nbytes)
        try:
            yield tensor_or_nbytes
        finally:
            self.free(name)


transient = Transient()  # the one tracker every building block reports to


@dataclass
class Ledger:
    """Bytes one rank holds: detail[category][location], plus transient and CUDA peaks."""
    detail: dict[str, dict[str, int]] = field(
        default_factory=lambda: {c: {loc: 0 for loc in LOCATIONS} for c in CATEGORIES})
    transient_peak: int = 0
    cuda_max_allocated: int | None = None  # torch.cuda.max_memory_allocated, None on CPU
    # torch.cuda.memory_allocated when measured: the allocator's live bytes, the ledger's ground
    # truth on CUDA (the peak above also holds activations
    # and cuBLAS's workspace, equal for every strategy)
    cuda_allocated: int | None = None

    @property
    def by_category(self) -> dict[str, int]:
        return {c: sum(locs.values()) for c, locs in self.detail.items()}

    @property
    def by_location(self) -> dict[str, int]:
        return {loc: sum(self.detail[c][loc] for c in CATEGORIES) for loc in LOCATIONS}

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    def as_dict(self) -> dict:
        return {"by_category": self.by_category, "by_location": self.by_location,
                "detail": {c: dict(locs) for c, locs in self.detail.items()},
                "total": self.total, "transient_peak": self.transient_peak,
                "cuda_max_allocated": self.cuda_max_allocated,
                "cuda_allocated": self.cuda_allocated}

    def __str__(self) -> str:
        mb = lambda x: f"{x / 1e6:>10.3f}"  # noqa: E731  (MB = 1e6 bytes, like the paper's GB)
        lines = [f"{'MB':<18}" + "".join(f"{h:>10}" for h in (*LOCATIONS, "total"))]
        for c in CATEGORIES:
            lines.append(f"{c:<18}" + "".join(mb(self.detail[c][loc]) for loc in LOCATIONS)
                         + mb(self.by_category[c]))
        lines.append(f"{'total':<18}" + "".join(mb(v) for v in self.by_location.values())
                     + mb(self.total))
        lines.append(f"{'transient peak':<18}{mb(self.transient_peak)}")
        if self.cuda_max_allocated is not None:
            lines.append(f"{'cuda max alloc':<18}{mb(self.cuda_max_allocated)}")
        if self.cuda_allocated is not None:
            lines.append(f"{'cuda allocated':<18}{mb(self.cuda_allocated)}")
        return "\n".join(lines)


def _entries(obj):
    """(category, tensor_or_nbytes, location_or_None) triples for one object."""
    if hasattr(obj, "memory_tensors"):
        # A wrapper knows its own layout (flat shards, host copies, files) better than a
        # generic walk, so its report replaces the walk even if it is a Module/Optimizer.
        yield from obj.memory_tensors()
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():  # tied weights appear once here; storages dedup the rest
            yield "parameters", p, None
            if p.grad is not None:
                yield "gradients", p.grad, None
        for b in obj.buffers():
            yield "buffers", b, None
    elif isinstance(obj, torch.optim.Optimizer):
        # Everything in optimizer.state, including Adam's 0-dim `step` counters: they are
        # real (tiny) bytes. Note that torch keeps them on the CPU unless capturable/fused,
        # so with CUDA params they show up under "host".
        for state in obj.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    yield "optimizer_state", v, None
    else:
        raise TypeError(f"measure() takes nn.Module, Optimizer or objects with "
                        f"memory_tensors(); got {type(obj).__name__}")


def measure(*objects, device=None) -> Ledger:
    """Walk the tensors of `objects` and add up their storages, each counted once.

    `device` is the compute device (default: current CUDA device if there is one, else
    CPU). Tensors on it count as "device". When computing on CUDA, CPU tensors count as
    "host". On a CPU-only run the CPU *is* the device. An explicit location in a
    memory_tensors() triple wins; plain ints need one (they are usually file bytes).
    Bytes are storage sizes, not allocator blocks (CUDA rounds those up to 512 B).
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    claimed: dict[tuple, tuple[int, str, int]] = {}  # storage key -> (precedence, loc, bytes)
    ledger = Ledger()
    for obj in objects:
        for category, x, location in _entries(obj):
            if category not in CATEGORIES:
                raise ValueError(f"unknown category {category!r}; use one of {CATEGORIES}")
            if location is not None and location not in LOCATIONS:
                raise ValueError(f"unknown location {location!r}; use one of {LOCATIONS}")
            n = _nbytes(x)
            if not torch.is_tensor(x):  # plain byte count: nothing to de-duplicate
                if location is None:
                    raise ValueError(f"an int entry ({category}, {n}) needs a location")
                ledger.detail[category][location] += n
                continue
            if n == 0:
                continue  # freed (resized to 0) or meta: holds nothing
            if location is None:
                on_device = x.device.type != "cpu" or device.type == "cpu"
                location = "device" if on_device else "host"
            key = (str(x.device), x.untyped_storage().data_ptr())
            rank = CATEGORIES.index(category)
            if key not in claimed or rank < claimed[key][0]:
                claimed[key] = (rank, location, n)
    for rank, location, n in claimed.values():
        ledger.detail[CATEGORIES[rank]][location] += n
    ledger.transient_peak = transient.peak
    if device.type == "cuda" and torch.cuda.is_available():
        ledger.cuda_max_allocated = torch.cuda.max_memory_allocated(device)
        ledger.cuda_allocated = torch.cuda.memory_allocated(device)
    return ledger


class SavedTensors:
    """The bytes autograd keeps for backward: activations, measured where they are kept.

        with SavedTensors({f"h.{i}": block for i, block in enumerate(model.h)},
                          exclude=model) as saved:
            loss = model(x, y)[1]
        saved.bytes["h.0"]  # layer 0's activations; everything outside the labelled
                            # modules: "other"

        meter = SavedTensors(exclude=stage.parameters())
        with meter.hooks():                 # the saved-tensor hooks only (no labels)
            out = stage(x)
        meter.live, meter.peak              # bytes held now / at most; backward frees them

    Every tensor autograd saves passes torch.autograd.graph.saved_tensors_hooks' pack hook, which
    packs it into a small holder; autograd drops the holder when it frees that saved tensor (after
    a backward without retain_graph, or when the graph dies), and the holder's __del__ says so.
    Each storage counts once (q, k and v may be views of one fused output; a node's input is the
    previous node's output), and the parameters of `exclude` (a module or tensors) not at all.
      bytes[label]  saved bytes by the label whose module was running when the storage was first
                    saved (a layer's input counts where a LayerNorm or matmul saves it);
      live, peak    the bytes held now and their high-water mark (pipeline stages, micro-batches).
    A DTensor counts its local shard. Framework-agnostic: it measures torch's own pipelining and
    tensor parallelism exactly as minizero's. Hooks do not nest: only the innermost meter sees a
    tensor. Never calls the formula (activation_bytes) it is compared with."""

    def __init__(self, modules: dict | None = None, exclude=None):
        params = exclude.parameters() if isinstance(exclude, torch.nn.Module) else (exclude or ())
        self.modules = modules or {}  # label -> module whose forward's saves get that label
        self.excluded = {self._key(p) for p in params}  # parameters: not activations
        self.bytes: dict[str, int] = {}        # label -> saved bytes (storages counted once)
        self.shapes: dict[str, list] = {}      # label -> (shape, dtype, bytes) of each new storage
        self.live = 0                          # bytes autograd holds now
        self.peak = 0                          # the most it held at once
        self._seen: set = set()                # storages already labelled
        self._refs: dict = {}                  # storage -> saved tensors holding it
        self._nbytes: dict = {}                # storage -> its bytes, while held
        self._stack = ["other"]
        self._handles: list = []

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        # a DTensor (torch's TP, the bench's peer): its local shard
        return getattr(t, "_local_tensor", t)

    def _key(self, t: torch.Tensor):
        t = self._local(t)
        return (str(t.device), t.untyped_storage().data_ptr())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor):
        local = self._local(tensor)
        if local.device.type == "meta":
            return tensor
        key = self._key(tensor)
        if key in self.excluded:
            return tensor
        nbytes = local.untyped_storage().nbytes()
        if key not in self._seen:
            self._seen.add(key)
            label = self._stack[-1]
            self.bytes[label] = self.bytes.get(label, 0) + nbytes
            self.shapes.setdefault(label, []).append((tuple(local.shape), str(local.dtype), nbytes))
        if not self._refs.get(key):
            self._nbytes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        # detach: a saved OUTPUT's grad_fn owns its saved variable, so holding the tensor itself
        # would make a cycle through C++ that no garbage collector sees (and never frees it)
        return _Saved(tensor.detach(), key, self)

    def _release(self, key):
        self._refs[key] -= 1
        if not self._refs[key]:
            self.live -= self._nbytes.pop(key)
            del self._refs[key]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def __enter__(self):
        def enter(label):
            return lambda *_: self._stack.append(label)  # None: the hook leaves the input alone

        def leave(*_):
            self._stack.pop()  # returns None: the hook leaves the output alone
        for label, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(enter(label)))
            self._handles.append(module.register_forward_hook(leave))
        self._hooks = self.hooks()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        return False


class _Saved:
    """What the pack hook returns: the saved tensor, and a word to the meter when autograd drops
    it."""
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Saved) else packed
