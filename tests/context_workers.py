"""What tests/test_context.py launches (never inside pytest). One 4-rank job: cp = 4 (one cp group)
and cp = 2 (two cp groups, dp = 2), ring attention (causal balanced, causal contiguous, not causal)
and Ulysses (causal, not causal), each against torch's scaled_dot_product_attention on the whole
sequence; one float64 ring run; the cp groups the Mesh built."""
import torch

from minizero.comm import Mesh
from minizero_course.experiments.context import attention_side_by_side

torch.set_num_threads(1)

CASES = [("ring", True, True), ("ring", True, False), ("ring", False, False), ("ulysses", True, False),
         ("ulysses", False, False)]


def case_name(cp, method, causal, balanced):
    return f"cp{cp}/{method}/{'causal' if causal else 'full'}" + ("/balanced" if balanced else "")


def run_all(comm):
    out = {}
    for cp in (4, 2):
        mesh = Mesh(comm, cp=cp)
        members = torch.zeros(mesh.cp.size, dtype=torch.int64)
        mesh.cp.all_gather(members, torch.tensor([comm.rank]))
        out[f"cp{cp}/group"] = {"members": members.tolist(), "groups": mesh.groups("cp"), "dp": mesh.groups("dp"),
                                "coords": [mesh.dp_rank, mesh.pp_rank, mesh.cp_rank, mesh.tp_rank]}
        for method, causal, balanced in CASES:
            out[case_name(cp, method, causal, balanced)] = attention_side_by_side(mesh.cp, method, causal, balanced)
        out[f"cp{cp}/ring/causal/balanced/float64"] = attention_side_by_side(mesh.cp, "ring", True, True,
                                                                             dtype=torch.float64)
    return out


def run_8(comm):
    """dp 2 x cp 2 x tp 2 on 8 ranks: the groups the Mesh built, and ring attention (causal,
    balanced) and Ulysses over each rank's cp group, with the tp and dp groups beside it."""
    mesh = Mesh(comm, dp=2, cp=2, tp=2)
    out = {"groups": {axis: mesh.groups(axis) for axis in ("dp", "cp", "tp")},
           "coords": [mesh.dp_rank, mesh.pp_rank, mesh.cp_rank, mesh.tp_rank]}
    for method in ("ring", "ulysses"):
        out[method] = attention_side_by_side(mesh.cp, method, True, True)
    return out


def run_torch(comm):
    """On the torch backend (gloo): ring attention and Ulysses at cp = 2, and torch's own
    context_parallel (the peer) on the same world."""
    from minizero_course.experiments.context import torch_context_parallel
    out = {method: attention_side_by_side(comm, method, True, True) for method in ("ring", "ulysses")}
    out["peer"] = torch_context_parallel(comm)
    out["backend"] = comm.backend
    return out
