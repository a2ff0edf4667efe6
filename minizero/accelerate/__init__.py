"""Hugging Face Accelerate's API on minizero's engine (docs/accelerate.md).

    accelerator.py  Accelerator: prepare, backward, accumulate, clip_grad_norm_, gather, save_state,
                    ...
    config.py       Accelerate's config YAML, its ACCELERATE_* variables and plugins, DeepSpeed's
                    "auto" filled
    data.py         the DataLoader shards Accelerate gives each rank (same batches, same order)
    local_sgd.py    LocalSGD: each rank steps on its own gradients, averaged every k steps
    launch.py       python -m minizero.accelerate.launch --config_file cfg.yaml script.py:
                    `accelerate launch`
    utils.py        accelerate.utils as the examples import it: set_seed, DistributedType, ...
"""
from minizero.accelerate.accelerator import AcceleratedOptimizer, AcceleratedScheduler, Accelerator
from minizero.accelerate.config import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from minizero.accelerate.utils import (DataLoaderConfiguration, DDPCommunicationHookType,
                                       DistributedDataParallelKwargs, DistributedType,
                                       ProfileKwargs)

__all__ = ["Accelerator", "AcceleratedOptimizer", "AcceleratedScheduler", "DataLoaderConfiguration",
           "DDPCommunicationHookType", "DeepSpeedPlugin", "DistributedDataParallelKwargs",
           "DistributedType", "FullyShardedDataParallelPlugin", "ProfileKwargs"]
