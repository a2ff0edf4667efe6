"""Hybrid sharding measured against ZeRO-3 and hpZ on the same simulated nodes (tests/test_hybrid.py).

`compare(comm, node_size)` trains the same TinyGPT from the same seed under ZeRO-3 (FSDP over the
world), ZeRO++'s hpZ alone (ZeroPP) and HybridShard, and the single-process model on the global batch,
`steps` SGD steps each. It returns per variant the last step's bytes by op, intra- vs cross-node
(comm.stats, per rank), the ledger after backward, the units' gathered sizes and the largest parameter
difference from the single process; the formulas are zeropp.formula's and hybrid.cross_node_bytes_per_node.
Under the torch backend it also trains the peer, torch FSDP2's HSDP (fully_shard over a 2-D DeviceMesh,
(replicate = nodes, shard = node_size)), and reports its largest parameter difference from the single
process (its bytes go through torch.distributed, which minizero does not count).
"""
from __future__ import annotations

import torch

from minizero import memory
from minizero.comm import Mesh
from minizero.data import shard
from minizero_course.experiments.references import global_batches
from minizero_course.experiments.zeropp import LESSON_GPT, _split
from minizero.models import build_model
from minizero.zero.fsdp import FSDP
from minizero.zero.hybrid import HybridShard
from minizero.zero.zeropp import ZeroPP

VARIANTS = ("ZeRO-3", "hpZ", "hybrid")
LR = 0.1


def _wrap(name, net, mesh):
    # no per-forward buffer broadcast: TinyGPT's buffers never change, and it is outside every formula here
    if name == "ZeRO-3":
        return FSDP(net, mesh.world, broadcast_buffers=False)
    if name == "hpZ":
        return ZeroPP(net, mesh, quantized_weights=False, hpz=True, quantized_gradients=False, broadcast_buffers=False)
    return HybridShard(net, mesh, broadcast_buffers=False)


def compare(comm, node_size=2, steps=3, micro=2) -> dict:
    torch.set_num_threads(1)
    mesh = Mesh(comm, node_size=node_size)
    ref = build_model("tiny-gpt", seed=0, **LESSON_GPT)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    batches = global_batches(ref, steps, micro * comm.size)
    for x, y in batches:
        ref(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    out = {"N": comm.size, "k": node_size, "variants": {}}
    for name in VARIANTS:
        net = build_model("tiny-gpt", seed=0, **LESSON_GPT)
        wrapped = _wrap(name, net, mesh)
        opt = torch.optim.SGD(wrapped.parameters(), lr=LR, momentum=0.9)
        for batch in batches:
            x, y = shard(batch, comm.rank, comm.size)
            comm.stats.reset()
            loss = wrapped(x, y)[1]
            forward = _split(comm)
            comm.stats.reset()
            loss.backward()
            backward = _split(comm)
            ledger = memory.measure(wrapped).by_category
            opt.step()
            opt.zero_grad(set_to_none=True)
        full = wrapped.gather_full_params()
        out["variants"][name] = {
            "forward": forward, "backward": backward, "ledger": ledger,
            "gathered_numel": [u.gathered_numel for u in wrapped.units],
            "max_param_diff": max(float((full[n] - p.detach()).abs().max()) for n, p in ref_params.items()),
            "psi": sum(p.numel() for p in ref_params.values())}
    if comm.backend == "torch":
        out["torch-hsdp"] = torch_hsdp(comm, node_size, batches, ref_params)
    return out


def torch_hsdp(comm, node_size, batches, ref_params) -> dict:
    """The peer: FSDP2 fully_shard with a (nodes, node_size) mesh is HYBRID_SHARD; same model, data, SGD."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (comm.size // node_size, node_size), mesh_dim_names=("replicate", "shard"))
    net = build_model("tiny-gpt", seed=0, **LESSON_GPT)
    for block in net.h:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    for batch in batches:
        x, y = shard(batch, comm.rank, comm.size)
        net(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    full = {n: p.full_tensor() for n, p in net.named_parameters()}
    return {"max_param_diff": max(float((full[n] - p.detach()).abs().max()) for n, p in ref_params.items()),
            "shard_numel": sum(p.to_local().numel() for p in net.parameters())}
