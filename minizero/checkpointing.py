"""`deepspeed.checkpointing`: activation checkpointing called from the model, as Megatron-style
models do.

    from minizero import checkpointing                  # DeepSpeed: deepspeed.checkpointing
    x = checkpointing.checkpoint(block, x)  # forward without keeping block's activations

checkpoint is torch.utils.checkpoint's non-reentrant one (it keeps the RNG state, so dropout
recomputes the same mask). configure() accepts DeepSpeed's defaults; partition_activations,
contiguous memory optimization and CPU checkpointing are refused (a ValueError naming each):
minizero does not implement them.
"""
from __future__ import annotations

import torch.utils.checkpoint

_CONFIGURED = False


def checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def configure(mpu_=None, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None):
    global _CONFIGURED
    if mpu_ is not None:
        raise ValueError("checkpointing.configure: mpu_ (Megatron's model-parallel unit) is not "
                         "supported")
    for name, value in (("partition_activations", partition_activations),
                        ("contiguous_checkpointing", contiguous_checkpointing),
                        ("checkpoint_in_cpu", checkpoint_in_cpu)):
        if value:
            raise ValueError(f"checkpointing.configure: {name}=True is not implemented by "
                             "minizero; leave it False")
    _CONFIGURED = True


def is_configured() -> bool:
    return _CONFIGURED


def reset():
    """DeepSpeed frees its checkpoint buffers here; torch's checkpoint keeps none."""
