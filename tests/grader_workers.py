"""Launch targets for tests/test_grader.py: a job that hangs and one that dies in native code."""
import os
import time


def sleep_forever(comm):
    time.sleep(3600)


def die_in_native_code(comm):
    if comm.rank == 1:
        os.abort()  # SIGABRT: no Python traceback, as a crash inside C code
    time.sleep(3600)


def echo(comm, impl, again=False):
    """What the file `impl` says, on every rank, after an all-reduce; a file that says `raise`
    fails on rank 1 (the other rank waits in a collective, as when a student's code raises)."""
    import torch
    text = open(impl).read().strip()
    if text == "raise" and comm.rank == 1:
        raise ValueError(f"rank 1 raises for {os.path.basename(os.path.dirname(impl))}")
    t = torch.ones(1)
    comm.all_reduce(t)
    return {"text": text, "ranks": int(t.item()), "comm": comm.name, "again": again}


def recv_first(comm):
    """Both ranks of a sub-group receive before they send: a point-to-point deadlock."""
    import torch
    group = comm.split(0, name="n2")  # a grader's sub-group, as lab 1's: not the student's name
    group.recv(torch.zeros(2), 1 - group.rank)


def skip_the_all_reduce(comm):
    """Rank 1 never calls the second all-reduce rank 0 waits in: a deadlock in a collective."""
    import torch
    group = comm.split(0, name="n2")
    group.all_reduce(torch.ones(3))
    if group.rank == 0:
        group.all_reduce(torch.ones(3))
    time.sleep(3600)
