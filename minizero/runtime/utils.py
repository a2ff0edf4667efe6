"""`deepspeed.runtime.utils.set_random_seed`: one seed for Python's, numpy's and torch's generators."""
from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int):
    """Seed random, numpy and torch (every device), as DeepSpeed's does."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
