"""Student bugs in solutions/lab01_ring_allreduce.py (ring all-reduce). See tests/mutants/__init__.py for the record."""
from tests.mutants import Mutant

MUTANTS = [
    Mutant("phase 1 sends the chunk of the wrong step (rank + s instead of rank - s)",
           "send_idx, recv_idx = (rank - s) % n, (rank - s - 1) % n",
           "send_idx, recv_idx = (rank + s) % n, (rank - s - 1) % n",
           "check_equals_allreduce", "chunk"),  # uneven chunks meet: MPI truncation, and its hint
    Mutant("phase 2 adds the received chunk instead of overwriting it (double counting)",
           "        comm.recv(chunks[recv_idx], left)\n        pending.wait()\n",
           "        incoming = scratch[:chunks[recv_idx].numel()]\n        comm.recv(incoming, left)\n"
           "        chunks[recv_idx].add_(incoming)\n        pending.wait()\n",
           "check_equals_allreduce", "do not add it to the partial sum"),
    Mutant("adds the whole scratch buffer, not the slice the chunk came in (wrong length on uneven chunks)",
           "chunks[recv_idx].add_(incoming)", "chunks[recv_idx].add_(scratch)",
           "check_equals_allreduce", "chunk"),
    Mutant("receives into a buffer the size of the chunk it sends (uneven chunks: truncation)",
           "incoming = scratch[:chunks[recv_idx].numel()]", "incoming = torch.empty_like(chunks[send_idx])",
           "check_equals_allreduce", "chunk"),
    Mutant("never waits for the phase-1 sends (missing wait)",
           "        pending.wait()  # the send buffer must not change until it has left\n", "",
           "check_equals_allreduce", "never waited"),
    Mutant("phase 2 runs N steps instead of N-1 (one chunk too many on the wire)",
           "    for s in range(n - 1):\n        send_idx, recv_idx = (rank + 1 - s) % n, (rank - s) % n",
           "    for s in range(n):\n        send_idx, recv_idx = (rank + 1 - s) % n, (rank - s) % n",
           "check_bytes", "2(N-1)/N*S"),
]

# Bugs that hang the ring: each costs its check's whole deadline (90 s times the load), so
# tests/test_grader.py's deadlock test grades them, not every run of the mutation suite.
DEADLOCKS = [
    Mutant("phase 1 receives from the right neighbour, which sends to its own right "
           "(a recv never matched)",
           "        comm.recv(incoming, left)\n", "        comm.recv(incoming, right)\n",
           "check_equals_allreduce", "recv from rank"),
]
