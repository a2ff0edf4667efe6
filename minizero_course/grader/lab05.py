"""Lab 05 checks: ZeRO-2's gradients, reduced into this rank's shard during backward (your
`_fill`, `_launch` and `_complete`), train like DDP, leave only the shard (and at most two
buckets) in memory, cost 2(N-1)/N·Ψ·4 bytes per step like DDP, and overlap backward: a bucket's
reduces are still in flight when the next gradient arrives (seen through the handles).

The harness is lab 04's (minizero_course.experiments.zero12.side_by_side), with stage=2; it also runs
a bf16 model and two accumulated micro-batches per step against DDP."""
from minizero_course.grader import Check, CheckFailed, Lab
from minizero_course.grader import lab04
from minizero_course.experiments.zero12 import side_by_side

LAB = Lab(5, "zero2", "ZeRO-2: gradients reduced into the shard during backward", "minizero/zero/shard_grad_op.py")

correctness_worker = lab04.correctness_worker  # launched as minizero_course.grader.lab05:...
measure_worker = lab04.measure_worker


def check_matches_ddp(impl):
    return lab04.check_matches_ddp(impl, stage=2, name="ShardGradOp")


def check_gradients_sharded(impl):
    lines = []
    for model in ("tiny-gpt", "edge"):
        for rank, out in enumerate(lab04.measured(impl, 2, "ShardGradOp")[:]):
            res = out[model]
            L, led, buckets = res["layout"], res["ledger"], res["bucket_numels"]
            if res["grads_left"]:
                raise CheckFailed(f"{model}: after backward, {res['grads_left']} parameters on rank {rank} still hold "
                                  "a full gradient in p.grad: set p.grad = None once it is copied into its bucket")
            want = L["shard_numel"] * 4
            if led["gradients"] != want:
                raise CheckFailed(f"{model}: gradients {led['gradients']} B on rank {rank}, expected the fp32 shard "
                                  f"only: {L['shard_numel']} elements = {want} B")
            cap = sum(sorted(buckets)[-2:]) * 4
            if res["backward_peak"] > cap:
                raise CheckFailed(f"{model}: bucket memory peaked at {res['backward_peak']} B on rank {rank}; with one "
                                  f"bucket in flight and one filling it is at most {cap} B. Free each bucket "
                                  "(memory.transient.free) once its reduces are done")
        r0 = lab04.measured(impl, 2, "ShardGradOp")[0][model]
        lines.append(f"{model}: gradients {r0['ledger']['gradients']} B per rank (DDP: "
                     f"{r0['ddp_ledger']['gradients']} B), bucket peak {r0['backward_peak']} B, N=4")
    return "\n".join(lines)


def check_overlap(impl):
    """Overlap, seen through the communicator's handles (experiments.timed_comm), not timing: when
    a gradient arrives after a bucket was launched, that bucket's reduces must still be in flight."""
    lines = []
    for model in ("tiny-gpt", "edge"):
        for rank, out in enumerate(lab04.measured(impl, 2, "ShardGradOp")):
            res = out[model]
            h = res["handles"]
            if h["never_waited"]:
                raise CheckFailed(f"{model}: rank {rank} never waited for {len(h['never_waited'])} of its "
                                  f"{h['reduces']} reduces ({h['never_waited'][0]}): wait() on every handle before the "
                                  "bucket is read, reused or freed")
            if h["blocking_reduces"]:
                raise CheckFailed(f"{model}: rank {rank} issued {h['blocking_reduces']} of {h['reduces']} bucket "
                                  "reduces blocking (async_op=False): backward stops until each is done, so nothing "
                                  "overlaps. Launch them with async_op=True and wait in _complete")
            if res["launched_in_hooks"] and not h["in_flight_at_a_gradient"]:
                raise CheckFailed(f"{model}: rank {rank} launched {res['launched_in_hooks']} buckets during backward, "
                                  "but no reduce was still in flight when the next gradient arrived: each was waited "
                                  "for at once, so communication never overlapped backward. Keep the handles in "
                                  "bucket.works and wait only in _complete")
        h = lab04.measured(impl, 2, "ShardGradOp")[0][model]["handles"]
        lines.append(f"{model}: {h['reduces']} async reduces in the last step, in flight at "
                     f"{h['in_flight_at_a_gradient']} gradient arrivals, all waited (rank 0, N=4)")
    return "\n".join(lines)


def check_bytes(impl):
    return lab04.check_bytes(impl, stage=2, name="ShardGradOp")


CHECKS = [
    Check("trains like DDP (N=3; SGD and Adam; tied, frozen, unused, padded; bf16; accumulation)", 5,
          check_matches_ddp),
    Check("only the gradient shard survives backward; buckets bounded (N=4)", 3, check_gradients_sharded),
    Check("bytes per step = 2(N-1)/N * padded Psi * 4 (N=4)", 2, check_bytes),
    Check("reduces overlap backward: still in flight when the next gradient arrives (N=4)", 2, check_overlap),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab05_zero2.py` shows."""
    res = side_by_side(comm, 2, impl.ShardGradOp, "tiny-gpt", opt="adam", steps=8)
    lab04.print_report(comm, res, "ZeRO-2")
    if comm.rank == 0:
        print(f"buckets (elements): {res['bucket_numels']}; launched during backward: {res['launched_in_hooks']} "
              f"of {len(res['bucket_numels']) * 8}; bucket memory peak {res['backward_peak']} B")
