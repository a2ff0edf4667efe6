"""Run by tests/test_comm.py in a subprocess: a course that already uses mp.spawn/torchrun
initializes torch.distributed itself; minizero must wrap that group as it is."""
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from minizero import comm
    c = comm.init()
    t = torch.full((6,), float(rank + 1))
    c.all_reduce(t)
    g = torch.empty(2 * world)
    c.all_gather(g, torch.full((2,), float(rank)))
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"backend": c.backend, "rank": c.rank, "size": c.size, "total": t[0].item(),
                   "gathered": g.tolist(), "sent": c.stats.sent()}, f)
    comm.shutdown()


if __name__ == "__main__":
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(worker, args=(3, port, sys.argv[1]), nprocs=3)
