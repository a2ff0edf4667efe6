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

Intra-node vs cross-node (ZeRO++'s instrument, lesson 08). A Mesh tells its communicator which
simulated node each rank is on; every byte a rank sends is then also booked as intra- or
cross-node, by where it goes, under the same model (`ring_bytes_split`):
  * ring ops (all_reduce, reduce_scatter, all_gather, broadcast, reduce): the ring visits the
    group's members in rank order, and a rank sends ALL its bytes to the next member (the last
    to the first). They are cross-node iff that neighbour is on another node. A group that spans
    nodes in consecutive blocks crosses once per node: per node, (N-1)/N * S crosses for
    an all-gather, whatever the node size (e.g. 4 ranks as 2 nodes x 2: ranks 1 -> 2 and 3 -> 0);
  * all_to_all: a rank sends S/N to each member directly: cross-node = S/N x (members off its node);
  * send: all of it to `dst`.
Without nodes (no Mesh, or node_size = world) everything is intra-node.
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


def ring_bytes_split(
    op: str, payload_bytes: int, nodes, index: int, peer: int | None = None
) -> tuple[float, float]:
    """(intra-node, cross-node) bytes that member `index` of a group sends for `op`, where
    nodes[i] is the node of member i (see the module docstring); `peer`: a send's destination."""
    sent = ring_bytes_sent(op, payload_bytes, len(nodes))
    if op == "all_to_all":
        cross = payload_bytes / len(nodes) * sum(node != nodes[index] for node in nodes)
    else:
        to = peer if op == "send" else (index + 1) % len(nodes)
        cross = sent if nodes[to] != nodes[index] else 0.0
    return sent - cross, cross


@dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0
    cross_node_bytes: float = 0.0  # the part of sent_bytes that left this rank's node


class CommStats:
    """Per-op counters. `reset()` at the start of a step to get bytes per step."""

    def __init__(self):
        self.ops: dict[str, OpStats] = defaultdict(OpStats)

    def add(self, op: str, payload_bytes: int, n: int, cross_node_bytes: float = 0.0):
        s = self.ops[op]
        s.calls += 1
        s.payload_bytes += payload_bytes
        s.sent_bytes += ring_bytes_sent(op, payload_bytes, n)
        s.cross_node_bytes += cross_node_bytes

    def sent(self, op: str | None = None) -> float:
        if op is not None:
            return self.ops[op].sent_bytes if op in self.ops else 0.0
        return sum(s.sent_bytes for s in self.ops.values())

    def cross_node(self, op: str | None = None) -> float:
        """Bytes sent to ranks on other nodes (all of them, or of one op)."""
        if op is not None:
            return self.ops[op].cross_node_bytes if op in self.ops else 0.0
        return sum(s.cross_node_bytes for s in self.ops.values())

    def intra_node(self, op: str | None = None) -> float:
        """Bytes sent to ranks on this rank's own node."""
        return self.sent(op) - self.cross_node(op)

    def reset(self):
        self.ops.clear()

    def as_dict(self) -> dict:
        return {op: vars(s).copy() for op, s in sorted(self.ops.items())}

    def __repr__(self):
        rows = [f"{op:>15}: {s.calls} calls, {s.payload_bytes / 1e6:.3f} MB payload, "
                f"{s.sent_bytes / 1e6:.3f} MB sent ({s.cross_node_bytes / 1e6:.3f} MB cross-node)"
                for op, s in sorted(self.ops.items())]
        return "CommStats(\n  " + "\n  ".join(rows) + "\n)" if rows else "CommStats()"


def bucket_numel_from_mb(bucket_cap_mb: float, module) -> int:
    """torch's bucket_cap_mb (MiB) -> gradients per bucket, for the module's trainable parameters'
    dtype."""
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0 (MiB, as torch DDP), got {bucket_cap_mb!r}")
    element_bytes = max((p.element_size() for p in module.parameters() if p.requires_grad),
                        default=4)
    return max(1, int(bucket_cap_mb * 2**20) // element_bytes)
