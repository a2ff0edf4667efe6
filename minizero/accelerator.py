"""DeepSpeed's `deepspeed.accelerator.get_accelerator()`: the device a rank computes on, CUDA or
CPU.

    # DeepSpeed: from deepspeed.accelerator import ...
    from minizero.accelerator import get_accelerator
    x = x.to(get_accelerator().current_device_name())      # "cuda:1" on a GPU rank, "cpu" on CPU

The device is the one minizero's communicator picks (comm.select_backend_and_device): CUDA when
present, one GPU per local rank, else the CPU. The method names and results are DeepSpeed's
CUDA_Accelerator's and CPU_Accelerator's (deepspeed/accelerator/cuda_accelerator.py,
cpu_accelerator.py): on the CPU, current_device() is the local rank and the memory queries read this
process's resident memory (Linux's /proc and getrusage), as DeepSpeed's CPU accelerator reads it
through psutil. Streams, events and graphs are not covered.
"""
from __future__ import annotations

import torch

from minizero.comm.launcher import local_rank, local_world_size


class Accelerator:
    """One class for both kinds: `self._name` is "cuda" or "cpu"."""

    def __init__(self, name: str):
        self._name = name
        self._communication_backend_name = "nccl" if name == "cuda" else "gloo"

    # ---------------------------------------------------------------- device
    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def device_name(self, device_index=None) -> str:
        return self._name if device_index is None or self._name == "cpu" else f"cuda:{device_index}"

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        if self._name == "cuda":
            return torch.cuda.current_device()
        return local_rank()  # DeepSpeed's CPU accelerator: LOCAL_RANK

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def set_device(self, device_index):
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        if self._name == "cuda":
            return torch.cuda.device_count()
        # DeepSpeed's CPU accelerator: the launcher's ranks on this node (its LOCAL_SIZE), else one
        return local_world_size() or 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._name == "cuda" else True

    def synchronize(self, device_index=None):
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned() if self._name == "cuda" else False

    # ---------------------------------------------------------------- random numbers
    def manual_seed(self, seed):
        torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed() if self._name == "cpu" else torch.cuda.initial_seed()

    def get_rng_state(self, device_index=None):
        return (
            torch.get_rng_state()
            if self._name == "cpu"
            else torch.cuda.get_rng_state(device_index or "cuda")
        )

    def set_rng_state(self, new_state, device_index=None):
        if self._name == "cpu":
            torch.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index or "cuda")

    # ---------------------------------------------------------------- memory, in bytes
    @staticmethod
    def _rss() -> int:
        import os
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @staticmethod
    def _peak_rss() -> int:
        import resource
        # KiB on Linux; the kernel updates it lazily, so it can trail the current resident size
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, Accelerator._rss())

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else self._rss()

    def max_memory_allocated(self, device_index=None) -> int:
        return (
            torch.cuda.max_memory_allocated(device_index)
            if self._name == "cuda"
            else self._peak_rss()
        )

    def reset_peak_memory_stats(self, device_index=None):
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._name == "cuda" else self._rss()

    def empty_cache(self):
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def total_memory(self, device_index=None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        import os
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None) -> int:
        if self._name == "cuda":
            free, _ = torch.cuda.mem_get_info(device_index)
            return free
        import os
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # ---------------------------------------------------------------- dtypes
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return self._name == "cuda"

    def supported_dtypes(self):
        return [torch.float32, torch.bfloat16] + ([torch.float16] if self._name == "cuda" else [])


_ACCELERATOR = None


def get_accelerator() -> Accelerator:
    """The process's accelerator: CUDA when torch sees a GPU (minizero's communicator uses it), else
    the CPU."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator("cuda" if torch.cuda.is_available() else "cpu")
    return _ACCELERATOR
