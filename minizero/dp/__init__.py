"""Data parallelism: every rank holds the whole model and a shard of the batch.

    data_parallel.py  DataParallel: one process, replicas (the old nn.DataParallel idea; lesson 02)
    ddp.py            DDP: gradients all-reduced in buckets, overlapped with backward (lab 02)
"""
from minizero.dp.data_parallel import DataParallel
from minizero.dp.ddp import DDP, GradBucket

__all__ = ["DDP", "DataParallel", "GradBucket"]
