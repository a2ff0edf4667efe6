"""Lab 13's mutants: plausible student bugs in the 1-bit compression and the compressed all-reduce
(solutions/lab13_onebit.py).
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
]
