"""What tests/test_moe.py launches (never inside pytest). One 4-rank job: the MoE model with
experts over ep = 4 (one expert-parallel group) and ep = 2 (two groups x expert-data parallel over
2), top-1 and top-2, with an even and a skewed router (uneven loads, dropped tokens), 3 SGD steps
each against the single-process reference; and the groups mesh.ep / mesh.expert_dp really hold."""
import torch

from minizero.comm import Mesh
from minizero_course.experiments.experts import side_by_side

torch.set_num_threads(1)

CASES = {  # name: (ep, k, capacity_factor, skew)
    "ep4/k1": (4, 1, 1.25, 0.0), "ep4/k2": (4, 2, 1.25, 0.0), "ep2/k1": (2, 1, 1.25, 0.0), "ep2/k2": (2, 2, 1.0, 0.0),
    "ep4/k1/uneven": (4, 1, 1.0, 1.0), "ep2/k2/uneven": (2, 2, 1.0, 1.0),
}


def groups(comm, ep):
    mesh = Mesh(comm, ep=ep)
    members = {}
    for axis in ("ep", "expert_dp"):
        group = getattr(mesh, axis)
        got = torch.zeros(group.size, dtype=torch.int64)
        group.all_gather(got, torch.tensor([comm.rank], dtype=torch.int64))
        members[axis] = got.tolist()
    return {"members": members, "groups": {a: mesh.groups(a) for a in members}, "ep_rank": mesh.ep_rank}


def run_all(comm):
    out = {"groups": {ep: groups(comm, ep) for ep in (2, 4)}}
    meshes = {ep: Mesh(comm, ep=ep) for ep in (2, 4)}
    for name, (ep, k, cf, skew) in CASES.items():
        out[name] = side_by_side(meshes[ep], k=k, capacity_factor=cf, skew=skew)
    return out
