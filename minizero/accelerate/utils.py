"""accelerate.utils as Accelerate's examples import it: `from accelerate.utils import set_seed`
becomes `from minizero.accelerate.utils import set_seed` (docs/accelerate.md).

    DistributedType           accelerator.distributed_type's type (Accelerate's str enum)
    DataLoaderConfiguration   Accelerator(dataloader_config=...): the seedable sampler and its seed
    set_seed                  random, numpy and torch seeded as Accelerate seeds them
    find_executable_batch_size   retry with 0.9 x the batch size after an out-of-memory error
    is_xpu_available, ...     False: minizero computes on CPUs and CUDA GPUs only
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import gc
import importlib.util
import inspect
import random

import numpy as np
import torch

from minizero.runtime.config import ConfigError


class DistributedType(str, enum.Enum):
    """Accelerate's names; minizero runs NO, MULTI_CPU, MULTI_GPU, DEEPSPEED and FSDP (the rest
    exist so that a script's comparisons, e.g. `== DistributedType.XLA`, evaluate to False)."""
    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"

    def __str__(self):
        return self.value


@dataclasses.dataclass
class DataLoaderConfiguration:
    """Accelerate's fields; the ones minizero does not cover must keep their defaults."""
    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self):
        # each: (the value minizero covers, what a rank does instead)
        covered = {"split_batches": (False, "each rank takes whole batches of the loader"),
                   "dispatch_batches": (None, "each rank reads its own batches"),
                   "even_batches": (True, "a short tail is completed with the first samples"),
                   "use_stateful_dataloader": (False, "save_state keeps no loader position")}
        for name, (value, instead) in covered.items():
            if getattr(self, name) not in (value, False if value is None else value):
                raise ConfigError(f"DataLoaderConfiguration({name}={getattr(self, name)!r}) is not "
                                  f"covered by minizero.accelerate: allowed {value!r} ({instead})")


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False):
    """Accelerate's set_seed: random, numpy, torch (every device); device_specific adds the rank."""
    if device_specific:
        from minizero import comm as comm_mod
        seed += comm_mod.get().rank if comm_mod.is_initialized() else 0
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)  # a no-op without CUDA
    if deterministic:
        torch.use_deterministic_algorithms(True)


_OOM_MESSAGES = (" out of memory.", "DefaultCPUAllocator: can't allocate memory",
                 "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.")


def should_reduce_batch_size(exception: Exception) -> bool:
    return isinstance(exception, RuntimeError) and len(exception.args) == 1 and \
        any(m in str(exception.args[0]) for m in _OOM_MESSAGES)


def find_executable_batch_size(function=None, starting_batch_size: int = 128,
                               reduce_batch_size_fn=None):
    """Accelerate's decorator: calls function(batch_size, ...) and, after an out-of-memory error,
    again with int(0.9 x batch_size) (or reduce_batch_size_fn()) until it fits or reaches 0."""
    if function is None:
        return functools.partial(find_executable_batch_size,
                                 starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size

    def reduce():
        nonlocal batch_size
        batch_size = reduce_batch_size_fn() if reduce_batch_size_fn else int(batch_size * 0.9)

    def decorator(*args, **kwargs):
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            raise TypeError(f"{function.__name__}: find_executable_batch_size passes the batch "
                            f"size as the first argument; call {function.__name__}"
                            f"({', '.join(params[1:])}) without it")
        while True:
            if batch_size <= 0:
                raise RuntimeError("find_executable_batch_size: no batch size fits in memory "
                                   "(reached 0)")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:
                if not should_reduce_batch_size(e):
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                reduce()
    return decorator


def _unavailable() -> bool:
    return False


# Accelerate's probes for other accelerators: minizero computes on CPUs and CUDA GPUs only
is_xpu_available = is_npu_available = is_mlu_available = is_hpu_available = _unavailable
is_torch_xla_available = _unavailable


def is_schedulefree_available() -> bool:
    return importlib.util.find_spec("schedulefree") is not None


class DDPCommunicationHookType(str, enum.Enum):
    """Accelerate's names for torch DDP's communication hooks; minizero's DDP runs NO only."""
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclasses.dataclass
class DistributedDataParallelKwargs:
    """Accelerator(kwargs_handlers=[...]): torch DDP's arguments. minizero's DDP reduces fp32
    buckets without hooks and broadcasts rank 0's buffers before each forward, so dim,
    broadcast_buffers and the comm_* fields must keep Accelerate's defaults (a ConfigError names
    the one that does not: a compressed all-reduce would change the losses); the bucketing ones
    are accepted."""
    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = dataclasses.field(default_factory=dict)

    # how torch DDP buckets and finds the gradients: no effect on the values it reduces
    _ACCEPTED = ("bucket_cap_mb", "find_unused_parameters", "check_reduction",
                 "gradient_as_bucket_view", "static_graph")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name in self._ACCEPTED:
                continue
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            value = getattr(self, f.name)
            if f.name in ("comm_hook", "comm_wrapper"):
                value = DDPCommunicationHookType(value)  # a bad name: Accelerate's ValueError
            if value != default:
                shown, allowed = (getattr(v, "value", v) for v in (value, default))  # 'fp16'
                raise ConfigError(f"DistributedDataParallelKwargs({f.name}={shown!r}) is not "
                                  f"covered by minizero.accelerate: only {allowed!r} (minizero's "
                                  "DDP all-reduces fp32 gradient buckets, with no hooks)")


@dataclasses.dataclass
class ProfileKwargs:
    """Accelerator(kwargs_handlers=[...]): the torch.profiler.profile that accelerator.profile()
    runs; output_trace_dir gets each rank's Chrome trace, profile_<rank>.json."""
    activities: list | None = None           # "cpu", "cuda" (Accelerate's names)
    schedule_option: dict | None = None      # torch.profiler.schedule's arguments
    on_trace_ready: object = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> torch.profiler.profile:
        kinds = {"cpu": torch.profiler.ProfilerActivity.CPU,
                 "cuda": torch.profiler.ProfilerActivity.CUDA}
        activities = None
        if self.activities is not None:
            bad = [a for a in self.activities if a not in kinds]
            if bad:
                raise ConfigError(f"ProfileKwargs(activities=...): {bad[0]!r} is not covered by "
                                  f"minizero.accelerate: use {sorted(kinds)}")
            activities = [kinds[a] for a in self.activities]
        schedule = None if self.schedule_option is None else \
            torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(activities=activities, schedule=schedule,
                                      on_trace_ready=self.on_trace_ready,
                                      record_shapes=self.record_shapes,
                                      profile_memory=self.profile_memory,
                                      with_stack=self.with_stack, with_flops=self.with_flops,
                                      with_modules=self.with_modules)


class DummyOptim:
    """Accelerate's stand-in for the optimizer a DeepSpeed config file names: importable (scripts
    pick it only when their config has an "optimizer" section), refused by prepare(), where
    minizero's engine would have to build the config's optimizer (not covered)."""

    def __init__(self, params, lr=0.001, weight_decay=0, **kwargs):
        self.params, self.lr, self.weight_decay, self.kwargs = params, lr, weight_decay, kwargs


class DummyScheduler:
    """Accelerate's stand-in for the DeepSpeed config's "scheduler": refused by prepare() too."""

    def __init__(self, optimizer, total_num_steps=None, warmup_num_steps=0,
                 lr_scheduler_callable=None, **kwargs):
        self.optimizer, self.total_num_steps = optimizer, total_num_steps
        self.warmup_num_steps, self.lr_scheduler_callable = warmup_num_steps, lr_scheduler_callable
        self.kwargs = kwargs
