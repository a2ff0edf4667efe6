"""What tests/test_nodes.py runs under two torchrun agents, two nodes of 2 ranks on this machine:
`torchrun --nnodes 2 --node-rank R --nproc-per-node 2 --rdzv-backend c10d ... tests/nodes_workers.py OUT`.

No node_size anywhere below but one explicit Mesh: the nodes are torchrun's, read by the Mesh. Each rank
reports torchrun's own view (its agent's pid, LOCAL_RANK, GROUP_RANK), the world ranks each group really
holds (an all-gather over the group), and one training step of hpZ, ZeRO++ and HybridShard on those
nodes: its bytes by op, intra- vs cross-node, as comm.stats booked them. It writes OUT/rank<R>.json, or
OUT/rank<R>.err with its traceback and exits at once (the test names the first rank to fail).
"""
import json
import os
import sys
import traceback

import torch

from minizero import comm
from minizero.comm import Mesh, MeshError
from minizero.data import shard
from minizero_course.experiments import zeropp as experiment
from minizero_course.experiments.references import global_batches
from minizero.models import build_model
from minizero.zero.hybrid import HybridShard

torch.set_num_threads(1)


def members(group, world):
    """The world ranks `group` holds, as the group itself sees them."""
    got = torch.zeros(group.size, dtype=torch.int64)
    group.all_gather(got, torch.tensor([world.rank], dtype=torch.int64))
    return got.tolist()


def one_step(world, wrapped, net):
    """This rank's bytes of one forward + backward, {"forward"|"backward": {op: [intra, cross]}}."""
    x, y = shard(global_batches(net, 1, 2 * world.size)[0], world.rank, world.size)
    world.stats.reset()
    loss = wrapped(x, y)[1]
    forward = experiment._split(world)
    world.stats.reset()
    loss.backward()
    return {"forward": forward, "backward": experiment._split(world),
            "gathered_numel": [unit.gathered_numel for unit in wrapped.units]}


def main(world):
    out = {"rank": world.rank, "size": world.size, "agent": os.getppid(),
           "env": {v: os.environ.get(v) for v in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}}
    explicit = Mesh(world, node_size=4)  # node_size given: it wins over the launcher's nodes
    out["explicit"] = {"node_size": explicit.node_size, "source": explicit.node_source,
                       "node": members(explicit.node, world)}
    tp = Mesh(world, tp=2)
    out["tp"] = {"node_size": tp.node_size, "source": tp.node_source, "tp": members(tp.tp, world),
                 "dp": members(tp.dp, world), "groups": tp.groups("tp")}
    try:
        Mesh(world, tp=4)
        out["tp4"] = None
    except MeshError as e:  # raised on every rank alike, before any split
        out["tp4"] = str(e)
    mesh = Mesh(world)  # built last: its nodes book the bytes below
    out["mesh"] = {"node_size": mesh.node_size, "source": mesh.node_source, "node": members(mesh.node, world),
                   "cross_node": members(mesh.cross_node, world), "groups": mesh.groups("node"), "repr": repr(mesh)}
    out["variants"] = {}
    for name in ("+hpZ", "ZeRO++", "hybrid"):
        net = build_model("tiny-gpt", seed=0, **experiment.LESSON_GPT)
        wrapped = (HybridShard(net, mesh, broadcast_buffers=False) if name == "hybrid"
                   else experiment.build(name, net, mesh, "fp32"))
        step = one_step(world, wrapped, net)
        if name == "hybrid":  # the shard group and the replicas' group
            step["groups"] = {"shard": members(wrapped.comm, world), "replicas": members(wrapped.replicas, world)}
        else:  # hpZ's node group and its secondary partition (elements this rank keeps for its node-mates)
            step["groups"] = {"node": members(wrapped.mesh.node, world)}
            step["secondary_numel"] = sum(t.numel() for t in wrapped.secondary.values())
        out["variants"][name] = step
    return out


if __name__ == "__main__":
    folder, rank = sys.argv[1], int(os.environ.get("RANK", "-1"))
    try:
        result = main(comm.init())
    except BaseException:  # noqa: BLE001  any failure, SystemExit too: named in the file, then this rank ends
        with open(os.path.join(folder, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)  # at once: an exit through atexit would wait in a barrier for the ranks waiting for this one
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
