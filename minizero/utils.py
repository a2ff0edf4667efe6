"""DeepSpeed's `deepspeed.utils` names that training scripts use: RepeatingLoader, logger,
log_dist."""
from __future__ import annotations

import logging

logger = logging.getLogger("minizero")
# DeepSpeed's logger prints INFO to stdout with a prefix; ours does the same
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [minizero] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class RepeatingLoader:
    """An iterator that starts `loader` again when it runs out (deepspeed/runtime/dataloader.py):
    the pipeline's `engine.train_batch(data_iter)` pulls micro-batches from it without an epoch
    loop."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def log_dist(message: str, ranks=None, level=logging.INFO):
    """Log on the listed ranks only (DeepSpeed's log_dist: ranks None or [-1] means every rank)."""
    from minizero import comm
    rank = comm.get().rank if comm.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")
