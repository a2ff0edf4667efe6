"""TimedComm: a Communicator that writes down when each collective was launched and waited for.

It changes nothing about what the wrapped code does: every call goes to the real Communicator.
For each collective it appends a record to `records`:

    {"op", "bytes", "async", "launch", "launched", "wait_start", "done"}

read on `clock`, which is any function: `time.perf_counter` for lesson 02's timeline, or a
logical clock such as "how many gradients are ready so far", which the lab checks use to see
overlap through the handles instead of through timing. A handle that is still in flight
(`in_flight()`: launched async and not waited yet) when the next bucket fills, or when the next
unit computes, is communication that could overlap compute; one waited at once never can.
"""
from __future__ import annotations

class _TimedWork:
    """The real handle, plus the clock when its wait() began and returned."""

    def __init__(self, work, rec, clock, alive):
        self._work, self._rec, self._clock, self._alive = work, rec, clock, alive

    def wait(self):
        if "wait_start" not in self._rec:
            self._rec["wait_start"] = self._clock()
        self._work.wait()
        self._rec.setdefault("done", self._clock())
        self._alive.pop(id(self._rec), None)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()


class TimedComm:
    """A Communicator whose collectives are also written down (see the module docstring)."""

    def __init__(self, comm, clock):
        self._comm = comm    # the real Communicator: every call goes there
        self._clock = clock  # what "when" means: seconds, or a logical counter
        self.records = []    # one dict per collective, in call order
        # the buffers of async ops not waited for yet, kept alive: code that frees a buffer before its op is
        # done (a missing wait) then reads a wrong value, which a check can name, instead of the backend
        # writing into freed memory and killing the rank with no message
        self._alive = {}

    def __getattr__(self, name):  # rank, size, device, stats, split, ...: the real ones
        return getattr(self._comm, name)

    def in_flight(self, op: str | None = None) -> list[dict]:
        """Records of async collectives (of `op`, or any) launched and not waited for yet."""
        return [r for r in self.records if r["async"] and "wait_start" not in r and op in (None, r["op"])]

    def _timed(self, op, tensor, call, async_op, *buffers):
        rec = {"op": op, "bytes": tensor.numel() * tensor.element_size(), "async": bool(async_op),
               "launch": self._clock()}
        self.records.append(rec)
        work = call()
        rec["launched"] = self._clock()  # a blocking call is also done here
        if work is None:
            rec["wait_start"], rec["done"] = rec["launch"], rec["launched"]
            return None
        self._alive[id(rec)] = (tensor, *buffers)
        return _TimedWork(work, rec, self._clock, self._alive)

    def all_reduce(self, tensor, op="sum", async_op=False):
        return self._timed("all_reduce", tensor, lambda: self._comm.all_reduce(tensor, op=op, async_op=async_op),
                           async_op)

    def reduce(self, tensor, dst=0, op="sum", async_op=False):
        return self._timed("reduce", tensor, lambda: self._comm.reduce(tensor, dst=dst, op=op, async_op=async_op),
                           async_op)

    def all_gather(self, output, input, async_op=False):
        return self._timed("all_gather", output, lambda: self._comm.all_gather(output, input, async_op=async_op),
                           async_op, input)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        return self._timed("reduce_scatter", input,
                           lambda: self._comm.reduce_scatter(output, input, op=op, async_op=async_op), async_op,
                           output)

    def broadcast(self, tensor, src=0, async_op=False):
        return self._timed("broadcast", tensor, lambda: self._comm.broadcast(tensor, src=src, async_op=async_op),
                           async_op)

    def isend(self, tensor, dst, tag=0):
        return self._timed("send", tensor, lambda: self._comm.isend(tensor, dst, tag), True)

    def irecv(self, tensor, src, tag=0):
        return self._timed("recv", tensor, lambda: self._comm.irecv(tensor, src, tag), True)

    def send(self, tensor, dst, tag=0):
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor, src, tag=0):
        self.irecv(tensor, src, tag).wait()
