"""The candidates `python -m minizero_course bench` runs, built the same way, and the counting it adds.

Each candidate is a TinyGPT wrapped by one library with that library's defaults, trained with
torch Adam in fp32. `build(name, ...)` returns a Candidate: backward(x, y) (forward, backward,
gradient synchronization), update() (optimizer step, zero_grad), and held(), the objects
memory.measure walks. For the libraries that do not report their own tensors, small adapters
walk them: FSDP2's DTensor shards, DeepSpeed's flat buffers, torch DDP's reducer buckets.

Bytes: minizero counts in minizero.comm. For torch and DeepSpeed, count_torch_collectives()
wraps torch.distributed's collectives so each call from Python adds to TORCH_STATS under the
same ring accounting as minizero.comm.
"""
from __future__ import annotations

import contextlib
import io
import os
import threading

import torch

from minizero.comm import CommStats
from minizero.models import build_model

# 3.2 M parameters (12.8 MB fp32) in 53 tensors: backward takes tens of ms per rank, an all-reduce of
# 12.8 MB a few: big enough that a step is not pure Python overhead, small enough for 2 cores.
BENCH_GPT = dict(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=256)
MINIZERO = ("minizero-ddp", "minizero-zero1", "minizero-zero2", "minizero-zero3", "minizero-zeropp")
# through the engine (fp32 Adam, the same torch Adam on the host): ZeRO-3 built under zero.Init, and offload
OFFLOAD = ("minizero-zero3-init", "minizero-zero2-offload", "minizero-zero2-dpu", "minizero-zero3-offload",
           "minizero-zero3-nvme", "minizero-zero3-nvme-noprefetch", "minizero-zero3-nvme-params")
TORCH = ("torch-ddp", "torch-fsdp2")
DEEPSPEED = tuple(f"deepspeed-z{s}" for s in range(4)) + ("deepspeed-z2-offload", "deepspeed-z3-offload",
                                                          "deepspeed-z3-nvme")
CANDIDATES = MINIZERO + OFFLOAD + TORCH + DEEPSPEED
DEFAULT = MINIZERO + ("minizero-zero2-offload", "minizero-zero3-offload") + TORCH + DEEPSPEED[:4]
REFERENCE = "torch-ddp"
# (candidate, baseline, largest paired step-time ratio allowed, the claim)
TARGETS = (("minizero-ddp", "torch-ddp", 1.05, "minizero DDP within 5% of torch DDP"),
           ("minizero-zero3", "torch-fsdp2", 1.00, "minizero ZeRO-3 no slower than torch FSDP2"),
           ("minizero-zeropp", "minizero-zero3", 1.25, "minizero ZeRO++ (qwZ+hpZ+qgZ, 2 nodes) within 1.25x of ZeRO-3"),
           ("minizero-zero2-offload", "minizero-zero2", 1.15, "ZeRO-2 + cpu offload within 1.15x of ZeRO-2"),
           ("minizero-zero3-offload", "minizero-zero3-init", 1.15, "ZeRO-3 + cpu offload within 1.15x of ZeRO-3"),
           ("minizero-zero2-dpu", "minizero-zero2-offload", 1.00, "DPU faster than no DPU"),
           ("minizero-zero3-nvme", "minizero-zero3-nvme-noprefetch", 1.00, "disk offload: prefetch faster than none"),
           ("minizero-zero2-offload", "deepspeed-z2-offload", 1.00,
            "minizero ZeRO-2 + offload no slower than DeepSpeed's"),
           ("minizero-zero3-offload", "deepspeed-z3-offload", 1.00,
            "minizero ZeRO-3 + offload no slower than DeepSpeed's"))


# ----------------------------------------------------------------------------- candidates
class Candidate:
    """backward(x, y) -> loss: forward, backward and gradient synchronization; update(): the optimizer
    step and zero_grad. A timed step is both; the ledger is read between them, when gradients and
    optimizer state both exist (the ZeRO paper's model states). held(): what memory.measure walks
    (or ledger(): the Ledger itself, for the engine)."""

    def __init__(self, backward, update, held, bytes_source, close=None, ledger=None):
        self.backward, self.update, self.held, self.bytes_source = backward, update, held, bytes_source
        self.close = close or (lambda: None)
        self.ledger = ledger


def _loop(wrapped, opt, finish=None):
    """The plain torch loop around `wrapped`; `opt` is anything with step() and zero_grad()."""
    def backward(x, y):
        loss = wrapped(x, y)[1]
        loss.backward()
        if finish:
            finish()
        return loss

    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return backward, update


def _adam(params, lr):
    return torch.optim.Adam(params, lr=lr)


def _minizero(name, model, comm, lr):
    if name == "minizero-ddp":
        from minizero.dp.ddp import DDP
        w = DDP(model, comm, mode="overlap")  # bucket_numel=6.25M fp32 = 25 MB (torch DDP: 25 MiB)
        opt = _adam(w.parameters(), lr)
        return Candidate(*_loop(w, opt, w.finish_gradient_synchronization), lambda: (w, opt), "minizero.comm")
    if name == "minizero-zero1":
        from minizero.zero.sharded_optimizer import ShardedOptimizer
        opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, comm, lr=lr)
        return Candidate(*_loop(model, opt), lambda: (model, opt), "minizero.comm")
    if name == "minizero-zero2":
        from minizero.zero.shard_grad_op import ShardGradOp
        w = ShardGradOp(model, torch.optim.Adam, comm, lr=lr)
        return Candidate(*_loop(w, w), lambda: (w,), "minizero.comm")
    if name == "minizero-zeropp":
        from minizero.comm import Mesh
        from minizero.zero.zeropp import ZeroPP
        nodes = 2 if comm.size >= 4 and comm.size % 2 == 0 else 1  # 2 simulated nodes (1 below 4 ranks)
        w = ZeroPP(model, Mesh(comm, node_size=comm.size // nodes))  # qwZ + hpZ + qgZ
        opt = _adam(w.parameters(), lr)
        return Candidate(*_loop(w, opt), lambda: (w, opt), "minizero.comm")
    from minizero.zero.fsdp import FSDP
    from minizero.zero.fsdp_optimizer import FSDPOptimizer
    w = FSDP(model, comm)
    opt = FSDPOptimizer(w, torch.optim.Adam, lr=lr)  # one run per unit shard, as the engine steps it
    return Candidate(*_loop(w, opt), lambda: (w, opt), "minizero.comm")


class _Buckets:
    """torch DDP's gradient buckets live in its C++ reducer; a comm hook sees them."""

    def __init__(self):
        self.buffers = {}

    def hook(self, process_group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        self.buffers[bucket.index()] = bucket.buffer()  # the reducer's own flat buffer, kept for the ledger
        return allreduce_hook(process_group, bucket)    # torch's default, through Python's dist.all_reduce

    def memory_tensors(self):
        for buf in self.buffers.values():
            yield "gradients", buf, None


def _engine(name, comm, cfg, seed, lr, micro, nvme_dir, sub_group_size=2_000_000):
    """minizero through its engine: fp32, torch Adam (no weight decay), as the other candidates."""
    from minizero.runtime.engine import build_engine
    from minizero.zero.init import Init
    stage = 2 if "zero2" in name else 3
    zero = {"stage": stage}
    if "offload" in name or "dpu" in name:
        zero["offload_optimizer"] = {"device": "cpu", "dpu_warmup_steps": 2 if "dpu" in name else None}
    if "nvme" in name:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
        zero["sub_group_size"] = sub_group_size  # 2M: 24 MB of master + Adam state per sub-group in host memory
    if "nvme-params" in name:  # ZeRO-Infinity's parameter tier too: the shards are mapped files
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": lr, "adam_w_mode": False}},
              "zero_optimization": zero, "aio": {"overlap_events": "noprefetch" not in name}}
    with Init(enabled=stage == 3):  # ZeRO-3 never holds the whole model on a rank
        model = build_model("tiny-gpt", seed=seed, **cfg)
    engine = build_engine(model, config, comm)

    def backward(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    def close():
        if engine.offload is not None:
            engine.offload.finish()
            getattr(engine.offload, "close", lambda: None)()
    return Candidate(backward, engine.step, lambda: (), "minizero.comm", close=close, ledger=engine.memory)


def _torch(name, model, comm, lr, count_ddp):
    import torch.nn as nn
    if name == "torch-ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        buckets = _Buckets()
        if count_ddp:  # memory phase only: the timed runs keep torch's C++ all-reduce
            ddp.register_comm_hook(None, buckets.hook)
        opt = _adam(ddp.parameters(), lr)
        src = "torch.distributed calls (default hook)" if count_ddp else "not counted"
        return Candidate(*_loop(ddp, opt), lambda: (model, opt, buckets), src)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (comm.size,))
    for block in model.h:  # one unit per block, like minizero's FSDP default wrap
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if any(p.is_meta for p in model.parameters()):  # built on the meta device, as FSDP2's docs recommend
        model.to_empty(device="cpu")
        model.reset_parameters(0)  # on the DTensor shards: each rank draws its own (values differ from the others)
    opt = _adam(model.parameters(), lr)
    return Candidate(*_loop(model, opt), lambda: (_DTensorLocal(model, opt),), "torch.distributed calls")


class _DTensorLocal:
    """FSDP2's parameters, gradients and Adam state are DTensors: walk their local shards."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def memory_tensors(self):
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        for p in self.model.parameters():
            yield "parameters", local(p), None
            if p.grad is not None:
                yield "gradients", local(p.grad), None
        for b in self.model.buffers():
            yield "buffers", b, None
        for state in self.opt.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    yield "optimizer_state", local(v), None


class _DeepSpeedHeld:
    """DeepSpeed's tensors, by the attribute names of its ZeRO optimizers (0.19): flat parameter
    buffers and stage-3 partitions (ds_tensor), fp32 partitions (master copies), gradient
    partitions and buffers, and the inner torch optimizer's state."""
    ATTRS = (("bit16_groups_flat", "parameters"), ("fp16_partitioned_groups_flat", "parameters"),
             ("single_partition_of_fp32_groups", "master_params"), ("fp32_partitioned_groups_flat", "master_params"),
             ("averaged_gradients", "gradients"), ("grads_in_partition", "gradients"),
             ("grad_partitions_flat_buffer", "gradients"), ("ipg_buffer", "gradients"))

    def __init__(self, engine):
        self.engine = engine

    @staticmethod
    def _tensors(x, cat):
        if torch.is_tensor(x):
            yield cat, x, None
            if x.grad is not None:
                yield "gradients", x.grad, None
        elif isinstance(x, (dict, list, tuple)):
            for v in (x.values() if isinstance(x, dict) else x):
                yield from _DeepSpeedHeld._tensors(v, cat)

    def memory_tensors(self):
        for p in self.engine.module.parameters():
            yield "parameters", p, None
            if getattr(p, "ds_tensor", None) is not None:
                yield "parameters", p.ds_tensor, None
            if p.grad is not None:
                yield "gradients", p.grad, None
        for b in self.engine.module.buffers():
            yield "buffers", b, None
        opt = self.engine.optimizer
        for attr, cat in self.ATTRS:
            yield from self._tensors(getattr(opt, attr, None), cat)
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    yield "optimizer_state", v, None


def _deepspeed(name, model, comm, lr, micro, nvme_dir=None, sized_to_model=False):
    import deepspeed
    stage = int(name[len("deepspeed-z")])
    # gradient_clipping: DeepSpeed 0.19's default is 1.0 (clip at global norm 1); everyone else here
    # does not clip, so switch it off or the loss curves part from the second step on.
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9}
    offload = name.endswith(("-offload", "-nvme"))
    if offload:  # ZeRO-Offload: DeepSpeed's own CPU Adam (DeepSpeedCPUAdam) steps on the host
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["optimizer"] = {"type": "Adam", "params": {"lr": lr, "weight_decay": 0.0, "adam_w_mode": False}}
    width = _deepspeed.cfg["n_embd"] if model is None else model.config.n_embd
    if sized_to_model and stage == 3:
        config["zero_optimization"].update(_deepspeed_stage3_sizes(width))
    if name.endswith("-nvme"):  # ZeRO-Infinity: optimizer state in files (its async-I/O op)
        config["zero_optimization"].update(_deepspeed_nvme(nvme_dir, width))
    if model is None:  # stage 3 at scale: built under DeepSpeed's zero.Init, partitioned module by module
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_model("tiny-gpt", seed=_deepspeed.seed, **_deepspeed.cfg)
    with contextlib.redirect_stdout(io.StringIO()):
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters()) \
            if offload else deepspeed.initialize(model=model, optimizer=_adam(model.parameters(), lr), config=config)

    def backward(x, y):
        loss = engine(x, y)[1]
        engine.backward(loss)  # reduces (or reduce-scatters) the gradients
        return loss
    return Candidate(backward, engine.step, lambda: (_DeepSpeedHeld(engine),), "torch.distributed calls",
                     close=getattr(engine, "destroy", None))


def _deepspeed_stage3_sizes(width):
    """ZeRO-3's buffers as Hugging Face's DeepSpeed integration sizes them ("auto", from the hidden size d):
    reduce_bucket_size d², stage3_prefetch_bucket_size 0.9·d², stage3_param_persistence_threshold 10·d.
    DeepSpeed's own defaults are one size for every model (reduce bucket 5e8 elements, prefetch bucket 5e7,
    persistence threshold 1e5); `bench scale` gives every library its large-model settings."""
    return {"reduce_bucket_size": width ** 2, "stage3_prefetch_bucket_size": int(0.9 * width ** 2),
            "stage3_param_persistence_threshold": 10 * width}


def _deepspeed_nvme(nvme_dir, width):
    """ZeRO-Infinity's optimizer state in files (offload_optimizer nvme: master weights, m and v), sized to the
    model: sub_group_size (the optimizer's swap unit; default 1e9 elements, 12 GB of fp32 state in flight) is
    two MLP weights. The parameters stay in RAM: DeepSpeed 0.19.8's parameter offload to nvme fails on this
    CPU machine whatever its buffer_count (at 135M on 4 ranks, 5 to 16 buffers: "Not enough buffers 0 for
    swapping 1", deepspeedai/DeepSpeed#3062, open since 2023; 46 and 58: "param 168 already assigned swap
    buffer id"; it ran only at 25M and below)."""
    return {"offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False, "buffer_count": 4},
            "sub_group_size": 2 * 4 * width ** 2}


# ----------------------------------------------------------------------------- counting torch's bytes
TORCH_STATS = CommStats()
_COUNTED = {  # name -> (op in the ring accounting, payload: the full tensor(s) as minizero.comm defines it)
    "all_reduce": ("all_reduce", lambda a: a[0]), "all_reduce_coalesced": ("all_reduce", lambda a: a[0]),
    "broadcast": ("broadcast", lambda a: a[0]), "reduce": ("reduce", lambda a: a[0]),
    "all_gather_single": ("all_gather", lambda a: a[0]), "all_gather_into_tensor": ("all_gather", lambda a: a[0]),
    "_all_gather_base": ("all_gather", lambda a: a[0]), "all_gather": ("all_gather", lambda a: a[0]),
    "reduce_scatter_single": ("reduce_scatter", lambda a: a[1]),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: a[1]),
    "_reduce_scatter_base": ("reduce_scatter", lambda a: a[1]), "reduce_scatter": ("reduce_scatter", lambda a: a[1]),
    "all_to_all_single": ("all_to_all", lambda a: a[1]),
}
_inside = threading.local()


def _nbytes(x):
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)  # a list of tensors


def count_torch_collectives():
    """Wrap torch.distributed's collectives so that each call from Python adds its bytes to
    TORCH_STATS under minizero.comm's ring model. Only the outermost call counts (one public
    function may call another). Calls made from C++ (torch DDP's reducer) are not seen."""
    import inspect

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    for name, (op, payload) in _COUNTED.items():
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "_minizero_counted", False):
            continue
        sig = inspect.signature(fn)
        first_two = list(sig.parameters)[:2]

        def counted(*args, _fn=fn, _op=op, _payload=payload, _sig=sig, _names=first_two, **kwargs):
            if getattr(_inside, "depth", 0) == 0:
                bound = _sig.bind_partial(*args, **kwargs).arguments
                TORCH_STATS.add(_op, _nbytes(_payload([bound.get(n) for n in _names])),
                                dist.get_world_size(bound.get("group")))
            _inside.depth = getattr(_inside, "depth", 0) + 1
            try:
                return _fn(*args, **kwargs)
            finally:
                _inside.depth -= 1
        counted._minizero_counted = True
        setattr(c10d, name, counted)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, counted)


# ----------------------------------------------------------------------------- building one
def start_deepspeed(comm):
    """Import DeepSpeed and let it adopt our torch.distributed group; None, or why not."""
    try:
        os.environ.update(RANK=str(comm.rank), WORLD_SIZE=str(comm.size), LOCAL_RANK=str(comm.rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import logging
        with contextlib.redirect_stdout(io.StringIO()):
            import deepspeed
            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
            deepspeed.init_distributed(dist_backend="gloo")
        return None
    except Exception as e:  # noqa: BLE001 - reported, and DeepSpeed skipped on every rank
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def build(name, comm, cfg, seed, lr, micro, count_ddp=False, meta_init=False, nvme_dir=None, sub_group_size=2_000_000,
          sized_to_model=False):
    """meta_init: the sharded peers build the way their docs say for large models (FSDP2 on the meta
    device, DeepSpeed ZeRO-3 under deepspeed.zero.Init); minizero's ZeRO-3 engine candidates always
    build under minizero.zero.Init. sized_to_model: DeepSpeed ZeRO-3's buffers sized from the model's width
    (_deepspeed_stage3_sizes), as `bench scale` runs it; the step-time bench keeps DeepSpeed's defaults."""
    if name in OFFLOAD:
        return _engine(name, comm, cfg, seed, lr, micro, nvme_dir, sub_group_size)
    if meta_init and name == "torch-fsdp2":
        with torch.device("meta"):
            model = build_model("tiny-gpt", seed=seed, **cfg)
        return _torch(name, model, comm, lr, count_ddp)
    if meta_init and name.startswith("deepspeed-z3"):
        _deepspeed.seed, _deepspeed.cfg = seed, cfg
        return _deepspeed(name, None, comm, lr, micro, nvme_dir, sized_to_model)
    model = build_model("tiny-gpt", seed=seed, **cfg)
    if name in MINIZERO:
        return _minizero(name, model, comm, lr)
    if name in TORCH:
        return _torch(name, model, comm, lr, count_ddp)
    return _deepspeed(name, model, comm, lr, micro, nvme_dir, sized_to_model)
