"""`deepspeed.runtime.utils`: set_random_seed and see_memory_usage, the two its example scripts
call."""
from __future__ import annotations

import gc
import random

import numpy as np
import torch


def set_random_seed(seed: int):
    """Seed random, numpy and torch (every device), as DeepSpeed's does."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def see_memory_usage(message: str, force: bool = False):
    """DeepSpeed's memory report: nothing unless force=True; then rank 0 logs the accelerator's
    allocated and peak memory (GiB, as DeepSpeed prints them) and resets the peak."""
    if not force:
        return
    from minizero import comm
    if comm.is_initialized() and comm.get().rank != 0:
        return
    from minizero.accelerator import get_accelerator
    from minizero.utils import logger
    gc.collect()
    acc, gib = get_accelerator(), 2 ** 30
    logger.info(message)
    logger.info(f"MA {acc.memory_allocated() / gib:.2f} GB         Max_MA "
                f"{acc.max_memory_allocated() / gib:.2f} GB         CA "
                f"{acc.memory_reserved() / gib:.2f} GB")
    acc.reset_peak_memory_stats()
