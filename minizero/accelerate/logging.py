"""accelerate.logging as the examples import it: `logger = get_logger(__name__)`, then
logger.info(msg, main_process_only=False, in_order=False) once the Accelerator exists.

Each message starts with "[RANK r] ". main_process_only=True (the default) logs on rank 0
only; in_order=True logs on every rank, one rank after the other (a barrier between them).
The level: log_level=, else ACCELERATE_LOG_LEVEL.
"""
from __future__ import annotations

import logging
import os

from minizero import comm as comm_mod


class MultiProcessAdapter(logging.LoggerAdapter):
    @staticmethod
    def _comm():
        if not comm_mod.is_initialized():
            # rank 0 cannot be told from the others before the communicator exists
            raise RuntimeError("minizero.accelerate.logging: create the Accelerator before logging "
                               "through get_logger's logger")
        return comm_mod.get()

    def process(self, msg, kwargs):
        # Accelerate's records say which rank wrote them: "[RANK 1] ..."
        return f"[RANK {self._comm().rank}] {msg}", kwargs

    def log(self, level, msg, *args, **kwargs):
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        comm = self._comm()
        if main_process_only:
            if comm.rank == 0:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
        elif in_order:
            for turn in range(comm.size):
                if turn == comm.rank:
                    msg, kwargs = self.process(msg, kwargs)
                    self.logger.log(level, msg, *args, **kwargs)
                comm.barrier()
        else:
            msg, kwargs = self.process(msg, kwargs)
            self.logger.log(level, msg, *args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    log_level = log_level or os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
