"""Every function a lesson or a lab check launches (with minizero.launch.run) to measure
something. They sit above the mechanisms and may use anything: models, data, references.

    references.py       the ground truth: one process on the full batch; torch's DDP
    loops.py            the few-line training loop of each strategy, as the lessons show it
    timed_comm.py       a Communicator that notes when each collective was launched and waited
    collectives.py      lesson 01: collective timings, the alpha-beta fit
    dp_ddp.py           lesson 02: DataParallel vs DDP modes, overlap, torch DDP
    mixed_precision.py  lesson 03: fp32 / fp16 / bf16 training, underflow, lost updates
    zero12.py           lessons 04-05: DDP and ZeRO-1/2 side by side, buckets, accumulation
    zero3.py            lesson 06: ZeRO-3 memory, bytes and prefetch
    pipeline.py         lesson 09, lab 09: one pipeline configuration trained and measured (events,
                        activations, bytes, distance to one process); the emulated device (TimedBlock)
"""
import time


def sleepy_barrier():
    """A barrier of the whole job that sleeps instead of spinning: ranks left out of a sub-group
    wait here, and MPICH's busy-polling would otherwise take the cores from the ranks that work."""
    from mpi4py import MPI
    req = MPI.COMM_WORLD.Ibarrier()
    while not req.Test():
        time.sleep(0.002)
