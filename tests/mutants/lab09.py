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
    Mutant("steady state backs the newest micro-batch", STEADY,
           STEADY.replace('Action("B", k)', 'Action("B", warmup + k)'),
           "check_valid", "runs B1 twice"),
]
MUTANTS += [
    Mutant("cool-down reversed: the last micro-batch's B first", COOLDOWN,
           COOLDOWN.replace("for k in range(num_microbatches - warmup, num_microbatches)",
                            "for k in reversed(range(num_microbatches - warmup, num_microbatches))"),
           "check_shape", "do not alternate as soon as they can"),
    Mutant("steady state restarts the forwards at micro-batch 0", STEADY, STEADY.replace("warmup + k", "k"),
           "check_valid", "runs F0 twice"),
]

# the stretch task, ZB-H1 (extra points): its own mutants, graded by check_zb_h1 alone
PENDING = "        if backwards - weights > rank:\n"
COOLDOWN_ZB = "    while backwards < num_microbatches:\n        backward()\n"
MUTANTS += [
    Mutant("ZB-H1: each W right after its B (none postponed: 1F1B's bubble)", PENDING,
           "        if backwards - weights > 0:\n", "check_zb_h1", "W's run too early"),
    Mutant("ZB-H1: one W too many kept pending", PENDING, "        if backwards - weights > rank + 1:\n",
           "check_zb_h1", "rank r keeps only r W's pending"),
    Mutant("ZB-H1: every W postponed to the end", PENDING, "        if backwards - weights > num_microbatches:\n",
           "check_zb_h1", "holds up to"),
    Mutant("ZB-H1: the cool-down runs the pending W's before the B's", COOLDOWN_ZB,
           "    while weights < backwards:\n        actions.append(Action(\"W\", weights))\n        weights += 1\n"
           + COOLDOWN_ZB, "check_zb_h1", "B's are delayed"),
    Mutant("ZB-H1: forgets the W's left at the end",
           '    return actions + [Action("W", k) for k in range(weights, num_microbatches)]\n',
           "    return actions\n", "check_zb_h1", "never runs W"),
]
ZB_WARMUP = ("    warmup = min(num_stages - rank - 1, num_microbatches)\n"
             "    actions = [Action(\"F\", k) for k in range(warmup)]\n")
MUTANTS += [
    Mutant("ZB-H1: one warm-up forward too many", ZB_WARMUP + "    backwards",
           ZB_WARMUP.replace("num_stages - rank - 1", "num_stages - rank") + "    backwards", "check_zb_h1",
           "too many warm-up forwards"),
]
