"""A job started by hand that meets a fault, for tests/test_faults.py: `mpirun -n N python tests/fault_script.py MODE`.

  fail_all  every rank fails alike after the start (end_job, exit code 2), as a --resume of missing files does
  stop      rank 1 stops itself (SIGSTOP) before a collective: the others block until the watchdog ends the job
  kill      rank 1 is killed (SIGKILL, as by the OOM killer) before a collective the others wait in
  plain     the same in a plain script (no watchdog.start: no job directory, no reaper)
"""
import os
import signal
import sys

import torch

from minizero import comm as comm_mod
from minizero.comm import watchdog

mode = sys.argv[1]
comm = comm_mod.init()
if mode != "plain":
    watchdog.start(comm)  # MINIZERO_WATCHDOG_S from the test
t = torch.ones(10)
comm.all_reduce(t)  # every rank is past start-up
if mode == "fail_all":
    watchdog.end_job(comm, f"fault_script: rank {comm.rank}: the input is bad", 2)
if comm.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
comm.all_reduce(t)
print(f"fault_script: rank {comm.rank} was never stopped", flush=True)
