"""Where a ZeRO strategy keeps its fp32 state and runs its step: on the device (the default), on the
host (ZeRO-Offload, Ren et al. 2021: zero/offload.py's HostOptimizer) or in files (ZeRO-Infinity,
Rajbhandari et al. 2021: zero/infinity.py's DiskOptimizer). And where ZeRO-3 keeps its parameter
shards between uses.

A strategy takes an OffloadSpec when it is built, and builds its tier itself:

    # ZeRO-1 + offload
    ShardedOptimizer(params, torch.optim.AdamW, comm, offload=OffloadSpec("cpu"))
    ShardGradOp(model, torch.optim.AdamW, comm, offload=OffloadSpec("cpu", dpu_warmup_steps=40))
    # ZeRO-Infinity
    FSDPOptimizer(FSDP(model), torch.optim.AdamW, offload=OffloadSpec("nvme", nvme_path="/scratch",
                                                                      params="nvme"))

Per rank and step, with the rank's Ψ/N parameters (ZeRO-Offload, Sec. 3.3 and 4.2): gradients go
down (g_bytes·Ψ/N), parameters come up (p_bytes·Ψ/N); the disk tier reads and writes the master and
the optimizer state (4·(1 + K/4)·Ψ/N each way, K = 8 for Adam's two moments). Every copy is counted
in the tier's `traffic`, where it is made.
"""
from __future__ import annotations

from typing import NamedTuple

from minizero.comm.labels import labelled
from minizero.zero.infinity import DiskOptimizer, release_pages
from minizero.zero.offload import HostOptimizer, OffloadedOptimizer, Traffic


class OffloadSpec(NamedTuple):
    """DeepSpeed's offload_optimizer / offload_param sections, as a strategy reads them."""
    device: str = "cpu"  # the optimizer's tier: "cpu" (host) or "nvme" (files; ZeRO-3 only)
    pin_memory: bool = False             # page-locked host buffers (CUDA only)
    # the delayed parameter update after this many plain steps (cpu)
    dpu_warmup_steps: int | None = None
    nvme_path: str | None = None         # where the optimizer's files go (nvme)
    # elements the disk tier steps at a time (DeepSpeed's sub_group_size)
    sub_group_numel: int = 10 ** 9
    prefetch: bool = True                # read sub-group i+1 while i steps (aio.overlap_events)
    io_threads: int = 1                  # aio.thread_count
    params: str = "none"  # ZeRO-3's parameter shards: "none" (device), "cpu" (host), "nvme" (files)
    param_nvme_path: str | None = None   # where the parameter files go (params "nvme")


class ZeroPPSpec(NamedTuple):
    """DeepSpeed's three ZeRO++ keys (zero_optimization.zero_*), as ZeRO-3's strategy reads them
    (zero/zeropp.py)."""
    quantized_weights: bool = False   # qwZ: int8 weight all-gathers
    hpz_partition_size: int = 1       # hpZ: ranks per node holding a secondary partition (1: off)
    quantized_gradients: bool = False  # qgZ: int4 hierarchical all-to-all gradient reduce

    @property
    def enabled(self) -> bool:
        return self.quantized_weights or self.quantized_gradients or self.hpz_partition_size > 1


def build_tier(spec: OffloadSpec, device_params, optimizer_cls, rank: int = 0, after_params=None,
               **optimizer_kwargs) -> OffloadedOptimizer:
    """The tier that steps `device_params` (flat fp32 or 16-bit device tensors) off the device;
    `rank` names its files."""
    if spec.device == "nvme":
        return DiskOptimizer(
            device_params,
            optimizer_cls,
            spec.nvme_path,
            spec.sub_group_numel,
            rank,
            Traffic(),
            prefetch=spec.prefetch,
            pin_memory=spec.pin_memory,
            after_params=after_params,
            io_threads=spec.io_threads,
            param_nvme_path=spec.param_nvme_path if spec.params == "nvme" else None,
            **optimizer_kwargs,
        )
    if spec.device != "cpu":
        raise ValueError(f"OffloadSpec.device must be 'cpu' or 'nvme', got {spec.device!r}")
    return HostOptimizer(device_params, optimizer_cls, Traffic(), spec.pin_memory,
                         spec.dpu_warmup_steps, after_params=after_params, **optimizer_kwargs)


class ShardSource:
    """ZeRO-3's parameter shards kept off the device (offload_param): each all-gather copies its
    shard in from the host (params "cpu") or from its mapped file (params "nvme"), counted in the
    tier's traffic."""

    def __init__(self, tier: OffloadedOptimizer, device):
        self.tier = tier  # whose traffic counts the copies (and whose files hold the shards, nvme)
        self.device = device  # where the all-gather runs

    # a profiler range (comm/labels.py): the shard in, from host or file
    @labelled("mz.offload.h2d")
    def __call__(self, unit, shard):
        nbytes = shard.numel() * shard.element_size()
        self.tier.traffic.to_device += nbytes
        copy = shard.to(self.device, copy=True)
        if getattr(self.tier, "param_dir", None) is not None:
            self.tier.traffic.disk_read += nbytes  # read out of the shard's file
            release_pages(shard)  # the file's pages leave this process again until the next gather
        return copy
