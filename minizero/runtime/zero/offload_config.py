"""DeepSpeed's `deepspeed.runtime.zero.offload_config` enums, with its members and values (DeepSpeed
0.19.8), for `engine.offload_states(include=..., device=...)` (runtime/trainer.py). The config
models of that module are DeepSpeed's pydantic classes; minizero reads the same sections from the
JSON config (runtime/config.py)."""
from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """Where offloaded tensors go."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The engine states offload_states can move (DeepSpeed's names)."""
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
