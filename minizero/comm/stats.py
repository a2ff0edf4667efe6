"""Byte accounting: what every collective costs, counted where it is called.

Every call adds to `comm.stats`: calls, payload bytes, and the bytes THIS rank sends under the
bandwidth-optimal ring model of that op, with S the payload and N ranks:
    all_reduce          2(N-1)/N * S      (reduce-scatter + all-gather)
    reduce_scatter      (N-1)/N * S       (S = the full, unscattered input)
    all_gather          (N-1)/N * S       (S = the full, gathered output)
    broadcast, reduce   (N-1)/N * S       (pipelined chain; averaged over ranks)
    all_to_all          (N-1)/N * S       (a rank keeps its own chunk)
    send                S                 recv, barrier: 0
The same accounting is used whichever backend runs, so the two give identical `stats`
(tests/test_comm.py checks both against these formulas, op by op).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


def ring_bytes_sent(op: str, payload_bytes: int, n: int) -> float:
    """Bytes one rank sends for `op` under the ring model (see module docstring)."""
    if op == "send":
        return float(payload_bytes)
    if n == 1 or op in ("recv", "barrier"):
        return 0.0
    factor = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0,
              "broadcast": 1.0, "reduce": 1.0, "all_to_all": 1.0}[op]
    return factor * (n - 1) / n * payload_bytes


@dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0


class CommStats:
    """Per-op counters. `reset()` at the start of a step to get bytes per step."""

    def __init__(self):
        self.ops: dict[str, OpStats] = defaultdict(OpStats)

    def add(self, op: str, payload_bytes: int, n: int):
        s = self.ops[op]
        s.calls += 1
        s.payload_bytes += payload_bytes
        s.sent_bytes += ring_bytes_sent(op, payload_bytes, n)

    def sent(self, op: str | None = None) -> float:
        if op is not None:
            return self.ops[op].sent_bytes if op in self.ops else 0.0
        return sum(s.sent_bytes for s in self.ops.values())

    def reset(self):
        self.ops.clear()

    def as_dict(self) -> dict:
        return {op: vars(s).copy() for op, s in sorted(self.ops.items())}

    def __repr__(self):
        rows = [f"{op:>15}: {s.calls} calls, {s.payload_bytes / 1e6:.3f} MB payload, "
                f"{s.sent_bytes / 1e6:.3f} MB sent" for op, s in sorted(self.ops.items())]
        return "CommStats(\n  " + "\n  ".join(rows) + "\n)" if rows else "CommStats()"
