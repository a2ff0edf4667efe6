"""Student bugs in solutions/lab05_zero2.py (ZeRO-2 gradient reduction). See tests/mutants/__init__.py for the
record."""
from tests.mutants import Mutant

MUTANTS = [
    Mutant("assigns the reduced part into the gradient shard instead of adding (accumulation broken)",
           "self.grad_shard[a - start:b - start].add_(part)", "self.grad_shard[a - start:b - start].copy_(part)",
           "check_matches_ddp", "ADD"),
    Mutant("waits for each reduce right after launching it (overlap lost)",
           "            bucket.works.append(self.comm.reduce(part, dst=owner, op=\"sum\", async_op=True))\n",
           "            work = self.comm.reduce(part, dst=owner, op=\"sum\", async_op=True)\n"
           "            work.wait()\n            bucket.works.append(work)\n",
           "check_overlap", "in flight"),
    Mutant("never waits for the bucket's reduces before reading and freeing it (missing wait)",
           "        for work in bucket.works:\n            work.wait()\n", "",
           "check_overlap", "never waited for"),
    Mutant("sums over ranks but forgets to divide by N (wrong averaging)",
           "part = bucket.buffer[a - bucket.lo:b - bucket.lo].div_(self.comm.size)",
           "part = bucket.buffer[a - bucket.lo:b - bucket.lo]",
           "check_matches_ddp", "not divided by N"),
    Mutant("copies the gradient but keeps p.grad (the full gradient survives backward: memory kept)",
           "            p.grad = None\n        bucket.filled[bucket.slot[i]] = True",
           "        bucket.filled[bucket.slot[i]] = True",
           "check_gradients_sharded", "still hold a full gradient"),
    Mutant("puts the gradient at its flat offset, not its offset inside the bucket (wrong offset)",
           "            a = self.layout.offsets[i] - bucket.lo\n", "            a = self.layout.offsets[i]\n",
           "check_matches_ddp", "bucket.lo"),
    Mutant("never reports the bucket to memory.transient (the free finds no buffer)",
           "            memory.transient.alloc(bucket.name, bucket.buffer)\n", "",
           "check_gradients_sharded", "transient.alloc"),
]
