"""Student bugs in solutions/lab02_bucketed_ddp.py (bucketed, overlapped DDP). See tests/mutants/__init__.py for the
record."""
from tests.mutants import Mutant

MUTANTS = [
    Mutant("copies the gradient into the bucket but keeps autograd's tensor (not a bucket view until finish)",
           "            p.grad = view  # frees autograd's own gradient tensor now, not at finish\n", "",
           "check_overlap_and_memory", "right after backward"),
    Mutant("launches each bucket as soon as it is full, not in bucket order (ranks disagree: deadlock family)",
           "            while self._next < len(self.buckets) and all(self.buckets[self._next].filled):\n"
           "                self._launch(self.buckets[self._next])\n",
           "            if all(self.buckets[b].filled):\n"
           "                self._launch(self.buckets[b])\n",
           "check_rank_orders", "same order"),
    Mutant("launches at most one bucket per gradient (if instead of while: full buckets wait for the next hook)",
           "            while self._next < len(self.buckets) and all(self.buckets[self._next].filled):",
           "            if self._next < len(self.buckets) and all(self.buckets[self._next].filled):",
           "check_rank_orders", "during backward"),
    Mutant("sums the gradients but never divides by N (wrong averaging)",
           "                bucket.buffer.div_(n)  # sum / N: the mean over the global batch\n", "",
           "check_equal", "not divided by N"),
    Mutant("a parameter unused on this rank keeps grad None even though another rank used it",
           "                    if had or view.any():", "                    if had:",
           "check_rank_orders", "another rank used"),
    Mutant("fill never marks the slot filled (no bucket is ever full during backward: overlap lost)",
           "        self.filled[i] = True\n", "",
           "check_overlap_and_memory", "during backward"),
]
MUTANTS += [
    Mutant("never waits for the buckets' all-reduces before dividing",
           "                for work in bucket.works:\n                    work.wait()\n", "",
           "check_equal", "never waited for"),
]
