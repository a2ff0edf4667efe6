"""Student bugs in solutions/lab04_zero1.py (the ZeRO-1 step). See tests/mutants/__init__.py for the record."""
from tests.mutants import Mutant

MUTANTS = [
    Mutant("all-gathers the old 16-bit shard instead of the updated master (invisible in fp32)",
           "send = self.master.to(self.flat.dtype, copy=True)", "send = self.shard.clone()",
           "check_matches_ddp", "UPDATED master"),
    Mutant("keeps master.grad after the step (Psi/N fp32 bytes held for nothing)",
           "            self.master.grad = None\n", "",
           "check_optimizer_state_sharded", "master.grad = None"),
    Mutant("all-gathers straight from the shard inside the flat buffer (no send copy: aliased buffers)",
           "send = self.master.to(self.flat.dtype, copy=True)", "send = self.master.to(self.flat.dtype)",
           "check_matches_ddp", "send buffer lies inside"),
    Mutant("forgets the inner optimizer step",
           "            self.step_masters(used)\n", "",
           "check_matches_ddp", "did not move"),
    Mutant("gives the fp32 master the 16-bit gradient without casting it (wrong dtype path)",
           "self.master.grad = grad_shard.to(self.master.dtype)", "self.master.grad = grad_shard",
           "check_matches_ddp", "dtype"),
    Mutant("divides the already averaged gradient by N again (wrong averaging)",
           "self.master.grad = grad_shard.to(self.master.dtype)",
           "self.master.grad = (grad_shard / self.comm.size).to(self.master.dtype)",
           "check_matches_ddp", "divided by N twice"),
    Mutant("all-gathers into the shard instead of the full flat buffer",
           "            self.comm.all_gather(self.flat, send)", "            self.comm.all_gather(self.shard, send)",
           "check_matches_ddp", "N times"),
]
