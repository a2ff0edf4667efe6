"""Student bugs in solutions/lab06_zero3.py (ZeRO-3 gather/free hooks). See tests/mutants/__init__.py for the record."""
from tests.mutants import Mutant

MUTANTS = [
    Mutant("a blocking all-gather (prefetch cannot overlap anything)",
           "unit.work = self.comm.all_gather(buf[:unit.gathered_numel], src, async_op=True)",
           "self.comm.all_gather(buf[:unit.gathered_numel], src)",
           "check_prefetch", "blocking"),
    Mutant("waits for the all-gather right after issuing it (overlap lost)",
           "unit.work = self.comm.all_gather(buf[:unit.gathered_numel], src, async_op=True)",
           "unit.work = self.comm.all_gather(buf[:unit.gathered_numel], src, async_op=True)\n"
           "            unit.work.wait()",
           "check_prefetch", "in flight"),
    Mutant("gathers into the whole buffer, persistent part included (wrong offsets)",
           "self.comm.all_gather(buf[:unit.gathered_numel], src, async_op=True)",
           "self.comm.all_gather(buf, src, async_op=True)",
           "check_matches_ddp", "N times"),
    Mutant("_free keeps the unit's reference to the gathered buffer (missing free)",
           "        unit.buf = None\n", "",
           "check_memory", "freed twice"),  # the kept buffer is freed again in backward: the hint names it
    Mutant("post-forward frees the buffer but leaves the module's attributes pointing at it (memory kept)",
           "        self._free(unit)\n        self._install(unit, None)\n", "        self._free(unit)\n",
           "check_memory", "still alive"),
    Mutant("reduce-scatters the sum instead of the average (wrong averaging)",
           "self.comm.reduce_scatter(shard_grad, g[:unit.gathered_numel], op=\"avg\")",
           "self.comm.reduce_scatter(shard_grad, g[:unit.gathered_numel], op=\"sum\")",
           "check_matches_ddp", "not divided by N"),
    Mutant("frees the buffer but never tells memory.transient (the bytes look held forever)",
           "        memory.transient.free(f\"{self._tag}/{unit.name}\")\n        unit.buf = None\n",
           "        unit.buf = None\n",
           "check_memory", "transient.free"),
]
