"""FlatShardOptimizer: flat fp32 shards that behave like a torch optimizer.

ZeRO steps flat shards cut through tensors (flat_layout.py): an elementwise optimizer (SGD, Adam,
AdamW, ...) does the same arithmetic on a slice of one big buffer as on each parameter. A user
thinks in parameters and param groups instead: nanoGPT's `configure_optimizers` gives AdamW a
decay group (the matrices) and a no-decay group (biases, LayerNorm), a torch LR scheduler edits
`param_groups[i]["lr"]`, a training script saves `optimizer.state_dict()`. This class bridges the
two; it is the base of ShardedOptimizer (ZeRO-1/2, sharded_optimizer.py) and FSDPOptimizer (ZeRO-3,
fsdp_optimizer.py), and a `torch.optim.Optimizer`, so torch's schedulers accept it unchanged.

  * `param_groups` are the USER's groups of model parameters, every hyperparameter filled in from
    the optimizer class's defaults, as torch's own optimizer would hold them. A parameter in two
    groups is an error (torch's rule); a frozen one is left out (it never gets a gradient).
  * The inner torch optimizer `self.optim` steps RUNS: maximal slices of this rank's fp32 shard(s)
    whose elements all belong to one group (padding joins the run before it). The flat layout
    orders parameters group by group, so a ZeRO-1 shard holds at most one run per group; a
    ZeRO-3 unit was cut at wrap time and may alternate. With one group, one run is the whole
    shard: state stays 1 tensor per shard, and every byte formula is the ungrouped one.
  * Before each inner step the groups' hyperparameters (lr, weight_decay, betas, ...) are copied
    into the inner groups (as torch's ZeroRedundancyOptimizer does): the scheduler's edits apply.
  * torch skips a parameter whose .grad is None: no weight decay, no momentum, no step count. A
    run cannot skip part of itself, so the step is MASKED: the elements of parameters that got no
    gradient are put back after the inner step, values and elementwise state alike (state created
    by that step starts at zero there), and a run with no used parameter gets grad None, so torch
    skips it, step counter included. What remains different: ONE step counter per run, so Adam's
    bias correction of a parameter skipped in EARLIER steps counts those steps, where torch
    counts per parameter. An always-unused parameter (an unused branch) is exactly torch's.
    Subclasses decide "used": a local gradient on this rank, or a nonzero averaged gradient
    (the rule of minizero.dp.ddp: unused on every rank means an exactly zero average).
  * state_dict(): torch's format ({"state": per inner tensor, "param_groups": hyperparameters and
    parameter indices}) plus the layout it belongs to; load_state_dict() takes it back on the
    same layout (same world size, rank, shapes, groups). The engine's checkpoints reshard.
"""
from __future__ import annotations

import torch

# Torch optimizers whose update of one element depends on other elements of its tensor.
NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")


def check_optimizer_class(optimizer_cls):
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError("pass an optimizer CLASS such as torch.optim.Adam (it is built on this "
                        f"rank's shard only); got a {type(optimizer_cls).__name__} object")
    if optimizer_cls.__name__ in NOT_ELEMENTWISE:
        raise ValueError(f"{optimizer_cls.__name__} is not elementwise: its update of one element "
                         "reads other elements of the tensor, so it cannot step a flat shard cut "
                         "through tensors. Use SGD, Adam, AdamW, RMSprop, Adagrad, ...")


def param_groups(params) -> list[dict]:
    """torch's `params` argument (tensors, or dicts with "params") -> groups of unique trainable
    parameters. A tied weight listed twice in one group counts once; in two groups it is an
    error."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of dicts (param groups), got one "
                        "tensor")
    groups = list(params)
    if not groups:
        raise ValueError("no trainable parameters: the params list is empty")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out, owner = [], {}
    for g, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"param group {g}: expected a dict with a 'params' list (do not mix "
                            "tensors and dicts)")
        tensors = (
            [group["params"]]
            if isinstance(group["params"], torch.Tensor)
            else list(group["params"])
        )
        keep = []
        for p in tensors:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param group {g} holds a {type(p).__name__}, not a tensor")
            if not p.requires_grad:
                continue
            if owner.setdefault(id(p), g) != g:
                raise ValueError(f"param groups overlap: a parameter of shape {tuple(p.shape)} is "
                                 f"in group {owner[id(p)]} and in group {g}; put each parameter in "
                                 "exactly one group")
            if not any(q is p for q in keep):
                keep.append(p)
        out.append({**group, "params": keep})
    if not owner:
        raise ValueError("no trainable parameters: the params list is empty, or every parameter "
                         "has requires_grad=False")
    return out


def covering_param_groups(module: torch.nn.Module, params, who: str) -> list[dict]:
    """param_groups(params), with every trainable parameter of `module` in exactly one group (a
    wrapper that owns the module's gradients, or an engine, needs them all)."""
    groups = param_groups(params)
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    grouped = {id(p) for g in groups for p in g["params"]}
    if grouped != trainable:
        raise ValueError(f"{who}: the param groups hold {len(grouped - trainable)} tensors that "
                         "are not trainable parameters of the model and miss "
                         f"{len(trainable - grouped)} that are: every trainable parameter must be "
                         "in exactly one group (requires_grad_(False) for the others)")
    return groups


class Run:
    """[lo, hi) of master shard `master`, all in param group `group`; the inner optimizer steps
    `tensor`, a view of it. pieces: (param index, lo, hi, offset): elements [lo, hi) of that
    (flattened) parameter are tensor[offset:offset + hi - lo]."""

    def __init__(self, master: int, group: int, lo: int, replicated: bool):
        self.master = master          # index into FlatShardOptimizer.masters
        self.group = group            # index into param_groups
        self.lo = lo                  # where the run starts in its master
        self.hi = lo                  # ... and ends (grows while pieces are added)
        self.replicated = replicated  # a tensor every rank holds whole (ZeRO-3's persistent ones)
        self.pieces = []
        self.tensor = None


class FlatShardOptimizer(torch.optim.Optimizer):
    """Base: param groups over flat shards. A subclass builds its masters, then calls
    _build_runs."""

    def __init__(self, params, optimizer_cls, optimizer_kwargs: dict):
        check_optimizer_class(optimizer_cls)
        groups = param_groups(params)
        # The class's own checks on every group's values,
        # on a dummy tensor: before anything changes.
        probe = optimizer_cls([{**{k: v for k, v in g.items() if k != "params"},
                                "params": [torch.zeros(1, requires_grad=True)]} for g in groups],
                              **optimizer_kwargs)
        self._sealed = False
        super().__init__(groups, probe.defaults)
        self._sealed = True
        self.optimizer_cls = optimizer_cls  # the torch optimizer that steps the runs
        self.optimizer_kwargs = optimizer_kwargs
        # the parameters in flat order: group by group, each once
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        # parameters (indices) stepped at least once: the others have no state yet
        self.stepped = set()

    def add_param_group(self, param_group: dict):
        if self._sealed:
            raise ValueError(f"{type(self).__name__}.add_param_group: the flat layout is fixed at "
                             "construction; pass every param group to the constructor")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ runs
    def _build_runs(self, masters, tier=None):
        """masters: [(fp32 1-D tensor, [(param index, lo, hi, offset)], elements before the padding,
        replicated)]. Cuts each into runs of one group; builds the inner optimizer on views of them,
        unless an offload tier (zero/tiers.py) steps the masters instead: then it is the inner
        optimizer."""
        self.masters = [m for m, _, _, _ in masters]
        self.runs = []
        last = len(self.param_groups) - 1
        for k, (master, pieces, data_end, replicated) in enumerate(masters):
            mine = []
            for index, lo, hi, off in sorted(pieces, key=lambda pc: pc[3]):
                run = mine[-1] if mine else None
                if run is None or run.group != self.group_of[index] or run.hi != off:
                    run = Run(k, self.group_of[index], off, replicated)
                    mine.append(run)
                run.pieces.append((index, lo, hi, off - run.lo))
                run.hi = off + hi - lo
            # a shard of padding only: stepped like any other (zero grad)
            if not mine and data_end == 0:
                mine.append(Run(k, last, 0, replicated))
            if mine and mine[-1].hi == data_end:
                mine[-1].hi = master.numel()  # the padding joins the last run
            self.runs.extend(mine)
        for run in self.runs:
            run.tensor = self.masters[run.master].detach()[run.lo:run.hi]
        if tier is not None:
            # the tier steps views of its masters, a param group per user group
            if len(self.param_groups) > 1:
                tier.regroup(
                    [(run.master, run.lo, run.hi, run.group) for run in self.runs],
                    [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                )
            # the scheduler edits the user's groups; each tier step copies them
            tier.param_groups = self.param_groups
            self.optim = tier
            return
        self.optim = self.optimizer_cls(
            [{**{k: v for k, v in g.items() if k != "params"},
              "params": [r.tensor for r in self.runs if r.group == i]}
             for i, g in enumerate(self.param_groups)], **self.optimizer_kwargs)

    @torch.no_grad()
    def step_masters(self, used: set):
        """One inner step on every master that has a .grad; parameters not in `used` are left as
        torch leaves a parameter without a gradient (module docstring)."""
        for inner, outer in zip(self.optim.param_groups, self.param_groups):
            inner.update((k, v) for k, v in outer.items() if k != "params")
        masked = []
        for run in self.runs:
            grad = self.masters[run.master].grad
            skip = [(off, hi - lo) for index, lo, hi, off in run.pieces if index not in used]
            if grad is None or (run.pieces and len(skip) == len(run.pieces)):
                run.tensor.grad = None  # torch skips it: no decay, no momentum, no step count
                continue
            run.tensor.grad = grad[run.lo:run.hi]
            if skip:
                state = self.optim.state.get(run.tensor, {})
                elementwise = {k: [v[a:a + n].clone() for a, n in skip] for k, v in state.items()
                               if torch.is_tensor(v) and v.shape == run.tensor.shape}
                masked.append((run, skip, [run.tensor[a:a + n].clone() for a, n in skip],
                               elementwise))
        self.optim.step()
        for run, skip, values, elementwise in masked:
            for (a, n), v in zip(skip, values):
                run.tensor[a:a + n] = v
            for k, v in self.optim.state[run.tensor].items():
                if torch.is_tensor(v) and v.shape == run.tensor.shape:
                    for i, (a, n) in enumerate(skip):
                        v[a:a + n] = elementwise[k][i] if k in elementwise else 0
        for run in self.runs:
            run.tensor.grad = None
        self.stepped.update(used)

    # ------------------------------------------------------------------ torch conventions
    def layout_signature(self) -> dict:
        """What a state dict of this optimizer only loads back into."""
        return {"world_size": self.comm.size, "rank": self.comm.rank,
                "shapes": [list(getattr(p, "full_shape", p.shape)) for p in self.params],
                "groups": [len(g["params"]) for g in self.param_groups]}

    def state_dict(self) -> dict:
        return self.local_state_dict()

    def local_state_dict(self) -> dict:
        """This rank's shard of the state, torch's format plus its layout (FSDP's
        LOCAL_STATE_DICT)."""
        inner, start, groups = self.optim.state_dict(), 0, []
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": inner["state"], "param_groups": groups, "layout": self.layout_signature(),
                "stepped": sorted(self.stepped)}

    def load_state_dict(self, state_dict: dict):
        want = self.layout_signature()
        if state_dict.get("layout") != want:
            got = state_dict.get("layout") or {}
            raise ValueError(f"{type(self).__name__}.load_state_dict: this state dict belongs to "
                             f"rank {got.get('rank')} of {got.get('world_size')} with "
                             f"{len(got.get('shapes', []))} parameters in groups of "
                             f"{got.get('groups')}; this is rank {want['rank']} of "
                             f"{want['world_size']} with {len(want['shapes'])} in groups of "
                             f"{want['groups']}. A shard loads only on the same layout; engine "
                             "checkpoints reshard.")
        inner = self.optim.state_dict()
        for mine, saved, inner_group in zip(self.param_groups, state_dict["param_groups"],
                                            inner["param_groups"]):
            hyper = {k: v for k, v in saved.items() if k != "params"}
            mine.update(hyper)
            inner_group.update(hyper)
        self.optim.load_state_dict({"state": state_dict["state"],
                                    "param_groups": inner["param_groups"]})
        self.stepped = set(state_dict["stepped"])

    def optimizer_state_tensors(self):
        for state in self.optim.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    yield "optimizer_state", v, None
