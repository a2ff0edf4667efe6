"""Lab 09's mutants: plausible student bugs in the 1F1B action list (`one_f_one_b`), as text
patches on solutions/lab09_one_f_one_b.py. tests/test_mutants.py grades them with every lab's, in two
launches (one simulating the action lists, one training with them)."""
from tests.mutants import Mutant

WARMUP = "chunk 0 (the default).\n    warmup = min(num_stages - rank - 1, num_microbatches)\n"
STEADY = '        actions += [Action("F", warmup + k), Action("B", k)]\n'
COOLDOWN = '    actions += [Action("B", k) for k in range(num_microbatches - warmup, num_microbatches)]\n'


def _warmup(expression):
    return WARMUP.replace("min(num_stages - rank - 1, num_microbatches)", expression)


MUTANTS = [
    # GPipe written instead: every forward first. Valid and exact, but it holds all m micro-batches.
    Mutant("all forwards first (GPipe)", WARMUP, _warmup("num_microbatches"),
           "check_memory", "held 8 micro-batches' activations at once"),
    Mutant("one warm-up forward too many", WARMUP, _warmup("min(num_stages - rank, num_microbatches)"),
           "check_shape", "too many warm-up forwards"),
    Mutant("one warm-up forward too few", WARMUP, _warmup("max(0, min(num_stages - rank - 2, num_microbatches))"),
           "check_shape", "too few warm-up forwards"),
    Mutant("warm-up not capped at m", WARMUP, _warmup("num_stages - rank - 1"),
           "check_valid", "is outside the 1 micro-batches"),
    Mutant("warm-up counted from the wrong end", WARMUP, _warmup("min(rank, num_microbatches)"),
           "check_valid", "deadlocks"),
    Mutant("backward before forward in the steady state", STEADY,
           '        actions += [Action("B", k), Action("F", warmup + k)]\n', "check_valid", "comes before F0"),
    Mutant("no cool-down", COOLDOWN, "", "check_valid", "never runs B"),
    Mutant("steady state backs the newest micro-batch", STEADY, STEADY.replace('Action("B", k)', 'Action("B", warmup + k)'),
           "check_valid", "runs B1 twice"),
]
