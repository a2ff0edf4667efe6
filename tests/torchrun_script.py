"""A plain training script as a course with torchrun scripts has one: no init_process_group, no
mpirun. Run by tests/test_launchers.py as `torchrun --nproc_per_node 2 tests/torchrun_script.py`."""
import json
import os
import time

import torch

from minizero import comm
from minizero.data import regression_batch, shard
from minizero.dp.ddp import DDP
from minizero.models import build_model

world = comm.init()  # torchrun's environment: minizero starts torch.distributed itself
model = build_model("mlp", seed=0)
ddp = DDP(model, world)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
if world.rank == 1:  # a step longer than the rendezvous wait (a billion-parameter step takes minutes): rank 0 waits
    time.sleep(float(os.environ.get("SLOW_RANK_S", "0")))  # in its first all-reduce, which must not time out
for step in range(3):
    x, y = shard(regression_batch(step, 8, 16, 4), world.rank, world.size)
    loss = ddp(x, y)[1]
    loss.backward()
    ddp.finish_gradient_synchronization()
    opt.step()
    opt.zero_grad()
    loss = loss.detach().reshape(1)
    world.all_reduce(loss, op="avg")  # the global batch's loss (equal shards)
    losses.append(loss.item())
print("RESULT " + json.dumps({"rank": world.rank, "size": world.size, "backend": world.backend, "losses": losses,
                              "params": [p.detach().sum().item() for p in model.parameters()]}), flush=True)
