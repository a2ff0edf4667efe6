"""A ZeRO-1/2 optimizer's whole state on one rank, in torch's per-parameter format, and back.

torch's ZeroRedundancyOptimizer convention: `optimizer.consolidate_state_dict(to=0)` on every rank
(a collective), then `optimizer.state_dict()` on rank 0 is what torch.optim's own optimizer on these
parameters would hold: {"state": {param index: {"exp_avg": full-shape tensor, ..., "step": ...}},
"param_groups": [...]}, indices in the order of the param groups. A plain torch.optim.AdamW on the
same parameters loads it; so does every rank's ShardedOptimizer, each taking its shard. 16-bit
parameters add "master_params" (the fp32 masters, per parameter).

The shard's runs (flat_shard_optimizer.py) tile it, so each elementwise state key is one shard-sized
tensor per rank, all-gathered into the padded flat layout and cut per parameter: one all-gather per
key (Adam: 2), Ψ elements each, plus three small all-reduces (who stepped what, the step counters).
A run's step counter is one per run; every parameter in it gets it. The ranks must hold the same
state keys (they do after any step: every rank steps its shard).
"""
from __future__ import annotations

import torch


def _elementwise(value, run) -> bool:
    return torch.is_tensor(value) and value.shape == run.tensor.shape


@torch.no_grad()
def consolidate(opt, to: int) -> dict | None:
    """The whole state on rank `to` (None elsewhere). A collective."""
    layout, comm = opt.layout, opt.comm
    states = [opt.optim.state.get(run.tensor, {}) for run in opt.runs]
    keys = sorted({k for st, run in zip(states, opt.runs) for k,
                   v in st.items() if _elementwise(v, run)})
    stepped = torch.zeros(len(opt.params))  # 1 where a rank stepped the parameter (it has state)
    steps = torch.zeros(len(opt.params), dtype=torch.float64)  # its run's step counter
    for run, st in zip(opt.runs, states):
        for index, _, _, _ in run.pieces:
            stepped[index] = float(index in opt.stepped)
            if "step" in st:
                steps[index] = float(st["step"])
    # Adam counts steps, SGD does not
    has_step = torch.tensor([float(any("step" in st for st in states))])
    for t in (stepped, steps, has_step):
        comm.all_reduce(t, op="max")
    full = {}
    for k in (*keys, *(["master"] if opt.mixed else [])):
        local = opt.master.detach().clone() if k == "master" else torch.zeros_like(opt.master)
        if k != "master":
            for run, st in zip(opt.runs, states):
                if k in st:
                    local[run.lo:run.hi] = st[k]
        full[k] = torch.empty(layout.padded_numel, dtype=local.dtype, device=local.device)
        comm.all_gather(full[k], local)
    if comm.rank != to:
        return None
    state, masters = {}, {}
    for i, p in enumerate(opt.params):
        a, n = layout.offsets[i], layout.numels[i]
        if "master" in full:
            masters[i] = full["master"][a:a + n].view(p.shape).clone()
        if stepped[i]:
            state[i] = {k: full[k][a:a + n].view(p.shape).clone() for k in keys}
            if has_step[0]:
                state[i]["step"] = torch.tensor(steps[i].item())
    sd = {"state": state, "param_groups": opt.local_state_dict()["param_groups"],
          "consolidated": True}
    if masters:
        sd["master_params"] = masters
    return sd


@torch.no_grad()
def load_consolidated(opt, state_dict: dict):
    """This rank's shard of a consolidated state dict into `opt` (its runs' inner state, the
    masters)."""
    shapes = [tuple(p.shape) for p in opt.params]
    saved = {i: tuple(v.shape) for i, st in state_dict["state"].items() for v in st.values()
             if torch.is_tensor(v) and v.dim()}
    if len(state_dict["param_groups"]) != len(opt.param_groups) or \
            any(i >= len(shapes) or shape != shapes[i] for i, shape in saved.items()):
        raise ValueError(f"{type(opt).__name__}.load_state_dict: the consolidated state belongs to "
                         f"other parameters ({len(state_dict['param_groups'])} groups, shapes "
                         f"{sorted(saved.items())[:3]}...) than this optimizer's "
                         f"({len(opt.param_groups)} groups, shapes {shapes[:3]}...)")
    inner, index = {}, 0
    # the inner optimizer's tensors: group by group, run by run
    for g in range(len(opt.param_groups)):
        for run in (r for r in opt.runs if r.group == g):
            pieces = [pc for pc in run.pieces if pc[0] in state_dict["state"]]
            if pieces:
                inner[index] = {}
                for k, v in state_dict["state"][pieces[0][0]].items():
                    if torch.is_tensor(v) and v.dim():
                        t = torch.zeros_like(run.tensor)
                        for i, lo, hi, off in pieces:
                            t[off:off + hi - lo] = state_dict["state"][i][k].reshape(-1)[lo:hi]
                        inner[index][k] = t
                    else:
                        inner[index][k] = v.clone() if torch.is_tensor(v) else v
            index += 1
    for mine, saved_group, inner_group in zip(opt.param_groups, state_dict["param_groups"],
                                              opt.optim.param_groups):
        hyper = {k: v for k, v in saved_group.items() if k != "params"}
        mine.update(hyper)
        inner_group.update(hyper)
    opt.optim.load_state_dict({"state": inner,
                               "param_groups": opt.optim.state_dict()["param_groups"]})
    mine = {pc.index for pc in opt.layout.pieces(opt.comm.rank)}
    opt.stepped = {i for i in state_dict["state"] if i in mine}
    if opt.mixed:
        for pc in opt.layout.pieces(opt.comm.rank):
            opt.master[pc.shard_lo:pc.shard_lo + pc.hi - pc.lo] = \
                state_dict["master_params"][pc.index].reshape(-1)[pc.lo:pc.hi]
