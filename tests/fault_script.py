"""A job started by hand that meets a fault, for tests/test_faults.py: `mpirun -n N python tests/fault_script.py MODE`.

  fail_all  every rank fails alike after the start (end_job, exit code 2), as a --resume of missing files does
  stop      rank 1 stops itself (SIGSTOP) before a collective: the others block until the watchdog ends the job
  kill      rank 1 is killed (SIGKILL, as by the OOM killer) before a collective the others wait in
  plain     the same in a plain script (no watchdog.start: no job directory, no reaper)
  engine    the same in a user's script whose entry point is minizero.initialize (it starts them)
  reaper    rank 0 kills its own reaper (the job's helper process), then the job ends normally
  ok        no fault: every rank says it was never stopped
  bad_config        a user's script calls minizero.initialize with zero_optimization.stage 5 (no communicator yet)
  bad_config_later  the same after the script started the communicator itself (deepspeed.init_distributed())
"""
import os
import signal
import sys

import torch

from minizero import comm as comm_mod
from minizero.comm import watchdog

mode = sys.argv[1]
BAD = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
       "zero_optimization": {"stage": 5}}
if mode == "bad_config":
    import minizero
    minizero.initialize(model=torch.nn.Linear(4, 4), config=BAD)
comm = comm_mod.init()
if mode == "bad_config_later":
    import minizero
    minizero.initialize(model=torch.nn.Linear(4, 4), config=BAD)
if mode == "engine":
    import minizero
    engine, *_ = minizero.initialize(model=torch.nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
elif mode != "plain":
    watchdog.start(comm)  # MINIZERO_WATCHDOG_S from the test
if mode == "reaper" and comm.rank == 0:
    watchdog._reaper.kill()
    watchdog._reaper.wait()
t = torch.ones(10)
comm.all_reduce(t)  # every rank is past start-up
if mode == "fail_all":
    watchdog.end_job(comm, f"fault_script: rank {comm.rank}: the input is bad", 2)
if comm.rank == 1 and mode not in ("reaper", "ok"):
    os.kill(os.getpid(), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
comm.all_reduce(t)
print(f"fault_script: rank {comm.rank} was never stopped", flush=True)
