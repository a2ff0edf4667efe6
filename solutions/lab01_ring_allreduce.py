# Lab 01: Ring all-reduce from send/recv
# GENERATED from minizero/comm/ring.py by `make labs`. Edit nothing: this is the reference solution.
#   run:   mpirun -n 4 python solutions/lab01_ring_allreduce.py
#   check: python -m minizero_course grade --lab 1 --impl solutions    (or: pytest -m lab1 --impl solutions)
"""Ring all-reduce built from point-to-point send/recv: what NCCL and MPI run for big messages.

N ranks stand in a ring (rank r sends to r+1, receives from r-1). The flat tensor is cut
into N chunks.

  Phase 1, reduce-scatter (N-1 steps). At step s rank r sends chunk (r - s) mod N to the
  right and receives chunk (r - s - 1) mod N from the left, adding it into its own copy.
  After N-1 steps rank r holds the complete sum of chunk (r + 1) mod N.

  Phase 2, all-gather (N-1 steps). At step s rank r sends chunk (r + 1 - s) mod N (which it
  holds complete) to the right and receives chunk (r - s) mod N from the left, overwriting.

Each rank sends 2(N-1) chunks of S/N bytes: 2(N-1)/N * S, independent of N for large N.
That is why the ring is bandwidth-optimal, and why minizero.comm counts an all-reduce as
exactly this many bytes. (Chunks differ by one element when N does not divide the size, so
then the bytes are equal to the formula only up to one element per step.)
"""
import torch


def ring_all_reduce(comm, tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks of `comm`, in place, using only isend/recv."""
    n, rank = comm.size, comm.rank
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor")
    chunks = list(torch.tensor_split(tensor.view(-1), n))  # views: writing them writes `tensor`
    right, left = (rank + 1) % n, (rank - 1) % n
    scratch = torch.empty(chunks[0].numel(), dtype=tensor.dtype, device=tensor.device)

    # phase 1, reduce-scatter: after it, this rank holds one chunk's full sum.
    #   What must hold: n - 1 steps; at each, every rank sends one chunk to `right` and receives one
    #   from `left`, and adds what arrives into its own copy of THAT chunk. A chunk gains one rank's
    #   term per hop, so it must travel the ring without a break: what a rank passes on at a step is
    #   the chunk it has just added to (at the first step, one of its own). After n - 1 hops each
    #   rank holds exactly one chunk with all n terms; which one decides where phase 2 starts.
    #   Every rank sends and receives at once: a blocking send on every rank can wait forever, so
    #   the send is posted (isend) and waited for only after the receive. The chunk being sent must
    #   not change before its send has completed, and a receive must fit its buffer exactly
    #   (tensor_split's chunks may differ by one element): receive into a piece of `scratch`.
    #   API: comm.isend(tensor, dst, tag=0) returns a request; request.wait() blocks until `tensor`
    #   may be reused. comm.recv(tensor, src, tag=0) blocks until `tensor` holds what src sent.
    for s in range(n - 1):
        send_idx, recv_idx = (rank - s) % n, (rank - s - 1) % n
        pending = comm.isend(chunks[send_idx], right)
        incoming = scratch[:chunks[recv_idx].numel()]
        comm.recv(incoming, left)
        pending.wait()  # the send buffer must not change until it has left
        chunks[recv_idx].add_(incoming)

    # phase 2, all-gather: pass the summed chunks around the ring.
    #   What must hold: afterwards every chunk on every rank is the full sum. Each rank starts with
    #   the one complete chunk phase 1 left it; at each of the n - 1 steps it passes on the complete
    #   chunk it got most recently (at the first step, that one) and receives the next complete
    #   chunk from `left`. What arrives is already the total: it replaces the partial copy, it is
    #   not added. It can land in its chunk directly, since that is never the chunk being sent. Same
    #   calls as phase 1, same rule for the pending send.
    for s in range(n - 1):
        send_idx, recv_idx = (rank + 1 - s) % n, (rank - s) % n
        pending = comm.isend(chunks[send_idx], right)
        comm.recv(chunks[recv_idx], left)
        pending.wait()
    return tensor


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(1, globals())
