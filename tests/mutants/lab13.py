"""Lab 13's mutants: plausible student bugs in the 1-bit compression and the compressed all-reduce, and in the
stretch task's 0/1 Adam policy (solutions/lab13_onebit.py).
tests/test_mutants.py grades them with every lab's, sharing one launch per check worker."""
from tests.mutants import Mutant

ERROR_UPDATE = "error.copy_(c - scale * unpack_signs(packed))"
PHASE_2 = '''    mine = _message(server_packed, server_scale)
    gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=x.device)
    comm.all_gather(gathered, mine)
    return _decode(gathered.view(world, -1)).reshape(-1)'''
PHASE_2_FP32 = '''    gathered = torch.empty(world * average.numel(), device=x.device)
    comm.all_gather(gathered, average)
    return gathered'''

VAR_RESET = """                    self.var_counter = 0
                    self.var_interval *= 2"""
VAR_COUNT = """            if step % self.var_interval == 0:
                self.var_counter += 1
                if"""
VAR_COUNT_EVERY_STEP = """            self.var_counter += 1
            if step % self.var_interval == 0:
                if"""

MUTANTS = [
    Mutant("scale is the mean of |c|, not its RMS", "scale = c.norm() / math.sqrt(c.numel())",
           "scale = c.abs().mean()", "check_compress", "the mean of |c|"),
    Mutant("the error is never added to x (c = x)", "c = x if error is None else x + error", "c = x",
           "check_compress", "the error was not added"),
    Mutant("the error kept is the negative of what was lost", ERROR_UPDATE,
           "error.copy_(scale * unpack_signs(packed) - c)", "check_compress", "negative of what was lost"),
    Mutant("the error is computed from x instead of c = x + error", ERROR_UPDATE,
           "error.copy_(x - scale * unpack_signs(packed))", "check_compress", "computed from x instead of c"),
    Mutant("the error is rebound, not written in place", ERROR_UPDATE,
           "error = c - scale * unpack_signs(packed)", "check_compress", "not updated in place"),
    Mutant("the server sums the N chunks instead of averaging them", "average = _decode(incoming).mean(dim=0)",
           "average = _decode(incoming).sum(dim=0)", "check_allreduce", "not sum them"),
    Mutant("chunk j of the signs goes to rank N-1-j", "packed.view(world, chunk // 8)])",
           "packed.view(world, chunk // 8).flip(0)])", "check_allreduce", "chunk j of the signs goes to rank j"),
    Mutant("the server's average is all-gathered in fp32, uncompressed", PHASE_2, PHASE_2_FP32,
           "check_allreduce", "1 bit per element"),
    Mutant("no error feedback on the server side", "compress(average, server_error)", "compress(average, None)",
           "check_feedback", "server error buffer is still zeros"),
    Mutant("no error feedback on the worker side", "compress(x, worker_error)", "compress(x, None)",
           "check_feedback", "worker error buffer is still zeros"),
    Mutant("0/1 Adam: the variance interval grows by one instead of doubling", "self.var_interval *= 2",
           "self.var_interval += 1", "check_zeroone", "not grow by one"),
    Mutant("0/1 Adam: the variance counter is never reset", VAR_RESET, "                    self.var_interval *= 2",
           "check_zeroone", "start again from 0 after each doubling"),
    Mutant("0/1 Adam: every step counts towards doubling the variance interval", VAR_COUNT, VAR_COUNT_EVERY_STEP,
           "check_zeroone", "counts only the variance steps"),
    Mutant("0/1 Adam: the local interval is not clipped", "min(self.local_step_clipper, self.local_interval * 2)",
           "self.local_interval * 2", "check_zeroone", "past local_step_clipper"),
    Mutant("0/1 Adam: the local counter is never reset", """                self.local_counter = 0
                self.local_interval""", """                self.local_interval""", "check_zeroone",
           "doubled at the wrong steps"),
]

# sign(0): the 1-bit code has no zero, every element decodes to +scale or -scale
MUTANTS += [
    Mutant("the error uses sign(c), which is 0 at c = 0", ERROR_UPDATE,
           "error.copy_(c - scale * c.sign())", "check_compress", "sign(0) must be +1"),
    Mutant("c = 0 packed as -1", "packed = pack_signs(c)",
           "packed = pack_signs(torch.where(c > 0, 1.0, -1.0))", "check_compress",
           "sign(0) must be +1"),
]

# messages that name the real cause
WORKER_SEND = '''    packed, scale = compress(x, worker_error)
    outgoing = torch.stack([_message(part, scale) for part in packed.view(world, chunk // 8)])'''
WORKER_PER_CHUNK = '''    errors = [None] * world
    if worker_error is not None:
        errors = worker_error.view(world, chunk)
    parts = zip(x.view(world, chunk), errors)
    outgoing = torch.stack([_message(*compress(part, e)) for part, e in parts])'''
VAR_ON_TIME = """        if not self.frozen(step):
            if step % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
"""
VAR_LATE = """        if not self.frozen(step):
            if self.var_counter == self.var_update_scaler:
                self.var_counter = 0
                self.var_interval *= 2
            if step % self.var_interval == 0:
                self.var_counter += 1
"""
MUTANTS += [
    Mutant("the worker compresses each chunk with its own scale", WORKER_SEND, WORKER_PER_CHUNK,
           "check_allreduce", "its own scale"),
    Mutant("0/1 Adam: the variance interval doubles one step late", VAR_ON_TIME, VAR_LATE,
           "check_zeroone", "one step late"),
]
