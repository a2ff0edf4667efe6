"""Expert parallelism, measured: what lesson 13, lab 12 and tests/test_moe.py launch.

The model is the smallest that has both kinds of parameter and a gradient through both all-to-alls:
tokens x [T, d] (T per rank, one GShard group each), u = Linear(x), h = u + MoELayer(u), a dense head
Linear(d, d), loss = MSE(head(h), target) + aux.
`side_by_side(mesh, ...)` trains it on mesh.dp ranks with experts over mesh.ep, and on every rank
the single-process reference: the same weights run by `reference_forward`, written with plain
loops over tokens (slots filled one by one, each expert applied to one token at a time), on every
rank's group, loss = the mean of the groups' losses. It returns, per step, the largest atol needed
(rtol 1e-6) for this rank's output, every gradient and (after the last SGD step) every parameter,
whether the routing (choices, kept, slots) is the reference's, tokens per expert and drops, and the
ep group's all-to-all bytes per pass next to dispatch.all_to_all_bytes.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from minizero.comm import Mesh
from minizero_course.experiments.tensor import atol_needed, sgd_step, worst
from minizero.moe import MoELayer, all_to_all_bytes, capacity, gradient_bytes, reduce_gradients

HIDDEN, FFN, EXPERTS, TOKENS, LR, STEPS = 8, 16, 4, 16, 0.05, 3


class MoEModel(nn.Module):
    """A dense input layer, u + MoE(u), then a dense head."""

    def __init__(self, hidden=HIDDEN, ffn=FFN, num_experts=EXPERTS, ep_comm=None, seed=0, **moe_kwargs):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(hidden, hidden)  # so the tokens the MoE dispatches need a gradient
        self.moe = MoELayer(hidden, ffn, num_experts, ep_comm, **moe_kwargs)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x, target):
        u = self.embed(x)
        out = self.head(u + self.moe(u))
        return out, F.mse_loss(out, target) + self.moe.aux_loss


class DenseModel(nn.Module):
    """The same shape with one MLP of k*f hidden units: the MoE model's active parameters per token."""

    def __init__(self, hidden=HIDDEN, ffn=FFN, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x, target):
        u = self.embed(x)
        out = self.head(u + self.mlp(u))
        return out, F.mse_loss(out, target)


def tokens(group: int, step: int, tokens=TOKENS, hidden=HIDDEN, skew=0.0):
    """Group `group`'s tokens and targets at `step`; skew > 0 adds skew * (1, 1, ..., 1) to every token."""
    gen = torch.Generator().manual_seed(1000 * step + group)
    x = torch.randn(tokens, hidden, generator=gen) + skew
    return x, torch.randn(tokens, hidden, generator=gen)


def skew_router(model: MoEModel, skew: float):
    """Turn expert 0's gate row towards where skewed tokens lie after the input layer (embed's W 1):
    the larger `skew`, the more first choices go to expert 0."""
    if skew:
        with torch.no_grad():
            direction = model.embed.weight.sum(1)
            model.moe.router.gate.weight[0] += skew * direction / direction.norm()


def reference_forward(model: MoEModel, x: torch.Tensor, target: torch.Tensor):
    """The single-process MoE of the same weights, by hand: (output, loss, choices, kept, slots)."""
    moe, router = model.moe, model.moe.router
    experts, k, num_experts = moe.experts, router.k, moe.num_experts
    x = model.embed(x)
    probs = F.softmax(x @ router.gate.weight.t(), dim=-1)
    top, choice = probs.topk(k, dim=-1)
    cap = capacity(x.shape[0], num_experts, k, router.capacity_factor)
    filled, kept, slot = [0] * num_experts, torch.zeros(x.shape[0], k, dtype=torch.bool), torch.zeros_like(choice)
    for j in range(k):              # first choices of every token, then second choices
        for t in range(x.shape[0]):
            e = int(choice[t, j])
            slot[t, j] = filled[e]
            kept[t, j] = filled[e] < cap
            filled[e] += 1
    gates = top * kept
    if k > 1:
        gates = gates / gates.sum(-1, keepdim=True).clamp_min(torch.finfo(gates.dtype).eps)
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros_like(x[t])
        for j in range(k):
            if kept[t, j]:
                e = int(choice[t, j])
                hidden = F.gelu(x[t] @ experts.w1[e] + experts.b1[e])
                row = row + gates[t, j] * (hidden @ experts.w2[e] + experts.b2[e])
        rows.append(row)
    first = F.one_hot(choice[:, 0], num_experts).float().mean(0)
    aux = router.aux_loss_coef * num_experts * (first * probs.mean(0)).sum()
    out = model.head(x + torch.stack(rows))
    return out, F.mse_loss(out, target) + aux, choice, kept, slot


def _local(name: str, ref: torch.Tensor, model: MoEModel) -> torch.Tensor:
    """The reference tensor's part this rank holds (its experts' slice for an expert parameter)."""
    experts = model.moe.experts
    if name.startswith("moe.experts."):
        return ref[experts.first_expert:experts.first_expert + experts.num_local]
    return ref


def side_by_side(mesh: Mesh, k=1, capacity_factor=1.25, steps=STEPS, skew=0.0, aux_loss_coef=0.01,
                 ops=None, seed=0) -> dict:
    """MoE over mesh.ep x expert-data-parallel over mesh.dp vs the single-process reference (module docstring)."""
    kwargs = dict(k=k, capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef)
    model = MoEModel(ep_comm=mesh.ep, seed=seed, ops=ops, **kwargs)
    ref = MoEModel(seed=seed, **kwargs)
    skew_router(model, skew)
    skew_router(ref, skew)
    ep, dp, group = mesh.ep_size, mesh.dp_size, mesh.dp_rank
    out = {"ep": ep, "dp": dp, "k": k, "capacity_factor": capacity_factor, "steps": []}
    for step in range(steps):
        ref_outs, ref_loss = [], 0.0
        for g in range(dp):
            o, loss, choice, kept, slot = reference_forward(ref, *tokens(g, step, skew=skew))
            ref_outs.append((o, choice, kept, slot))
            ref_loss = ref_loss + loss / dp
        ref_loss.backward()
        x, target = tokens(group, step, skew=skew)
        if mesh.ep is not None:
            mesh.ep.stats.reset()
        mesh.world.stats.reset()
        o, loss = model(x, target)
        forward_sent = mesh.ep.stats.sent("all_to_all") if mesh.ep is not None else 0.0
        loss.backward()
        a2a_sent = mesh.ep.stats.sent("all_to_all") if mesh.ep is not None else 0.0
        mesh.world.stats.reset()
        reduce_gradients(model, mesh.dp, mesh.expert_dp)
        grad_sent = mesh.world.stats.sent("all_reduce")
        routing, (ref_o, choice, kept, slot) = model.moe.last_routing, ref_outs[group]
        grads = {n: p.grad for n, p in model.named_parameters()}
        ref_grads = {n: _local(n, p.grad, model) for n, p in ref.named_parameters()}
        cap = routing.capacity
        out["steps"].append({
            "output": atol_needed(o.detach(), ref_o.detach()),
            "loss": [loss.item(), ref_loss.item()],
            "grads": worst(grads, ref_grads),
            "grad_errors": {n: atol_needed(grads[n], ref_grads[n]) for n in ref_grads},
            "routing_equal": [torch.equal(routing.expert_index, choice), torch.equal(routing.kept, kept),
                              torch.equal(torch.where(kept, routing.positions, 0), torch.where(kept, slot, 0))],
            "tokens_per_expert": routing.tokens_per_expert(EXPERTS),
            "kept_per_expert": routing.kept_per_expert(EXPERTS),
            "dropped": routing.dropped(), "capacity": cap,
            "all_to_all": {"forward": forward_sent, "backward": a2a_sent - forward_sent,
                           "formula_one": all_to_all_bytes(EXPERTS, cap, HIDDEN, 4, ep)},
            "gradient_all_reduce": {"sent": grad_sent, "formula": sum(gradient_bytes(model, dp, ep).values())}})
        sgd_step(model.parameters(), LR)
        sgd_step(ref.parameters(), LR)
    params = {n: p.detach() for n, p in model.named_parameters()}
    out["params"] = worst(params, {n: _local(n, p.detach(), model) for n, p in ref.named_parameters()})
    return out


def dropped_vs_capacity(factors=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0), k=1, skew=0.0, tokens_per_group=64, seed=0):
    """One process, one routing per capacity factor: dropped choices measured (the layer's kept mask)
    next to sum_e max(0, n_e - C) from the tokens per expert n_e (the formula)."""
    rows = []
    for cf in factors:
        model = MoEModel(seed=seed, k=k, capacity_factor=cf)
        skew_router(model, skew)
        x, target = tokens(0, 0, tokens=tokens_per_group, skew=skew)
        with torch.no_grad():
            model(x, target)
        r = model.moe.last_routing
        counts = r.tokens_per_expert(EXPERTS)
        rows.append({"capacity_factor": cf, "capacity": r.capacity, "tokens_per_expert": counts,
                     "dropped": r.dropped(), "formula": sum(max(0, n - r.capacity) for n in counts),
                     "choices": k * tokens_per_group})
    return rows


def routing_over_steps(mesh: Mesh, steps=20, aux_loss_coef=0.01, skew=1.0, k=1, capacity_factor=1.25, lr=0.2):
    """Train the skewed model over mesh.ep x mesh.dp; per step the tokens per expert summed over the dp
    ranks (an all-reduce of the counts), and the drops."""
    model = MoEModel(ep_comm=mesh.ep, k=k, capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef)
    skew_router(model, skew)
    history = []
    for step in range(steps):
        _, loss = model(*tokens(mesh.dp_rank, step, skew=skew))
        loss.backward()
        reduce_gradients(model, mesh.dp, mesh.expert_dp)
        sgd_step(model.parameters(), lr)
        r = model.moe.last_routing
        counts = torch.tensor(r.tokens_per_expert(EXPERTS) + [r.dropped()], dtype=torch.float64)
        mesh.dp.all_reduce(counts)
        history.append({"tokens_per_expert": counts[:-1].long().tolist(), "dropped": int(counts[-1])})
    return history


def moe_vs_dense(comm, steps=6, hidden=64, ffn=256, tokens_per_rank=512, k=1, capacity_factor=1.25):
    """Step time and bytes per step: MoE with E = 2 * world experts over ep = world ranks, against the
    dense model with one MLP of k*f hidden units (the same active parameters per token) under
    data-parallel gradient all-reduce on the same ranks. Median of `steps` timed steps after one warm-up."""
    mesh = Mesh(comm, ep=comm.size)
    num_experts = 2 * comm.size
    runs = {"moe": MoEModel(hidden, ffn, num_experts, mesh.ep, k=k, capacity_factor=capacity_factor),
            "dense": DenseModel(hidden, k * ffn)}
    out = {"experts": num_experts, "world": comm.size, "hidden": hidden, "ffn": ffn, "tokens": tokens_per_rank}
    for name, model in runs.items():
        times = []
        for step in range(steps + 1):
            x, target = tokens(comm.rank, step, tokens=tokens_per_rank, hidden=hidden)
            comm.barrier()
            comm.stats.reset()
            start = time.perf_counter()
            _, loss = model(x, target)
            loss.backward()
            reduce_gradients(model, mesh.dp, mesh.expert_dp)
            sgd_step(model.parameters(), 0.01)
            times.append(time.perf_counter() - start)
        sent = {op: s["sent_bytes"] for op, s in comm.stats.as_dict().items()}
        params = sum(p.numel() for p in model.parameters())
        formula = {"gradients": sum(gradient_bytes(model, mesh.dp_size, mesh.ep_size).values())}
        if name == "moe":
            cap = model.moe.last_routing.capacity
            formula["all_to_all"] = 4 * all_to_all_bytes(num_experts, cap, hidden, 4, mesh.ep_size)
        out[name] = {"step_ms": sorted(times[1:])[len(times[1:]) // 2] * 1e3, "sent": sent, "formula": formula,
                     "params_on_rank": params}
    return out


def lesson(comm, steps=30) -> dict:
    """Everything lesson 13 measures on 4 ranks, in one job: equality and bytes (ep 4 top-1, ep 2 x
    expert-dp 2 top-2), the routing of a skewed router over `steps` steps with and without the
    balancing loss, and MoE vs dense step time and bytes."""
    meshes = {ep: Mesh(comm, ep=ep) for ep in (2, 4)}
    return {"ep4/k1": side_by_side(meshes[4], k=1, steps=1, skew=1.0, capacity_factor=1.0),
            "ep2/k2": side_by_side(meshes[2], k=2, steps=1),
            "routing": {str(coef): routing_over_steps(meshes[4], steps=steps, aux_loss_coef=coef)
                        for coef in (0.0, 0.1)},
            "dense": moe_vs_dense(comm)}
