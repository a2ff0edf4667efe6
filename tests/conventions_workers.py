"""What tests/test_conventions.py runs through minizero.launch: ONE 4-rank job (sub-communicators
for 3 ranks) that trains every strategy against torch's own DistributedDataParallel on the same
data, with what a torch training script brings along: param groups, an LR scheduler, state dicts,
parameters that get no gradient, BatchNorm buffers. Every number returned is measured."""
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minizero.comm import init_torch_distributed
from minizero.data import regression_batch, shard
from minizero.dp.ddp import DDP
from minizero_course.experiments.references import global_batches
from minizero.models import build_model
from minizero.runtime.engine import build_engine
from minizero.zero.fsdp import FSDP
from minizero.zero.fsdp_optimizer import FSDPOptimizer
from minizero.zero.shard_grad_op import ShardGradOp
from minizero.zero.sharded_optimizer import ShardedOptimizer

torch.set_num_threads(1)
GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
STEPS, BATCH = 4, 12  # 12 rows divide over 3 and 4 ranks


class Branchy(nn.Module):
    """A branch used only while `use_branch` (the loop turns it off after BRANCH_STEPS steps) and a
    parameter never used: torch's optimizers skip both whenever their .grad is None."""
    BRANCH_STEPS = 2

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)
        self.unused = nn.Parameter(torch.empty(3, 2))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.use_branch = True

    def forward(self, x, y=None):
        h = torch.tanh(self.fc(x))
        if self.use_branch:
            h = h + self.branch(h)
        out = self.head(h)
        return out, (F.mse_loss(out, y) if y is not None else None)


class Norm(nn.Module):
    """A BatchNorm between two layers: its running statistics change in every training forward."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 1)
        with torch.no_grad():
            for p in (self.fc.weight, self.fc.bias, self.head.weight, self.head.bias):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x, y=None):
        out = self.head(torch.relu(self.bn(self.fc(x))))
        return out, (F.mse_loss(out, y) if y is not None else None)


def regression(steps, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(steps)]


def nanogpt_groups(model, weight_decay):
    """nanoGPT's configure_optimizers: matrices decay, biases and LayerNorm weights do not."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]


# ---------------------------------------------------------------------------- one training run
def train(comm, torch_group, strategy, make_model, opt, batches, groups=None, schedule=False,
          before_step=None, engine_stage=None, hook=None, **wrap):
    """-> (final full state dict under the original names, the optimizer, the plain model).
    opt: (torch optimizer class, kwargs); groups(model) -> param groups or None; before_step(model,
    step) runs before each step; hook(model) once the model is wrapped."""
    cls, kw = opt
    model = make_model()
    params = groups(model) if groups else None
    engine, fwd = None, model
    if strategy == "torch":  # the ground truth: torch's DDP (its reducer marks unused parameters ready)
        fwd = nn.parallel.DistributedDataParallel(model, process_group=torch_group, find_unused_parameters=True,
                                                  **wrap)
        optim = cls(params or model.parameters(), **kw)
    elif strategy == "ddp":
        fwd = DDP(model, comm, **wrap)
        optim = cls(params or model.parameters(), **kw)
    elif strategy == "z1":
        optim = ShardedOptimizer(params or model.parameters(), cls, comm, **kw)
    elif strategy == "z2":
        fwd = ShardGradOp(model, cls, comm, params=params, **wrap, **kw)
        optim = fwd.optim
    elif strategy == "z3":
        fwd = FSDP(model, comm, **wrap)
        optim = FSDPOptimizer(fwd, cls, params, **kw)  # groups of the ORIGINAL parameters map to the shards
    elif strategy == "z3-plain":  # torch's own optimizer on FSDP's local parts, grouped by their full shapes
        fwd = FSDP(model, comm, **wrap)
        named = [p for _, p in fwd.named_parameters() if p.requires_grad]
        optim = cls([{"params": [p for p in named if len(p.full_shape) >= 2],
                      "weight_decay": params[0]["weight_decay"]},
                     {"params": [p for p in named if len(p.full_shape) < 2], "weight_decay": 0.0}]
                    if params else named, **kw)
    else:  # the engine, DeepSpeed's loop, param groups as DeepSpeed's model_parameters
        cfg = {"train_micro_batch_size_per_gpu": len(batches[0][0]) // comm.size, "gradient_clipping": 0.0,
               "optimizer": {"type": cls.__name__, "params": dict(kw)},
               "zero_optimization": {"stage": engine_stage, "stage3_param_persistence_threshold": 0}}
        engine = build_engine(model, cfg, comm, model_parameters=params)
        optim = engine.optimizer
    comm.stats.reset()  # what the steps send, not the construction
    if hook:
        hook(model)
    sched = torch.optim.lr_scheduler.StepLR(optim, 2, gamma=0.5) if schedule else None
    for s, batch in enumerate(batches):
        if before_step:
            before_step(model, s)
        x, y = shard(batch, comm.rank, comm.size)
        if engine is not None:
            engine.backward(engine(x, y))
            engine.step()
            continue
        fwd(x, y)[1].backward()
        if strategy == "ddp":
            fwd.finish_gradient_synchronization()
        (fwd if strategy == "z2" else optim).step()
        (fwd if strategy == "z2" else optim).zero_grad()
        if sched is not None:
            sched.step()
    if engine is not None:
        return engine.full_state_dict(), engine, model
    if strategy in ("z3", "z3-plain"):
        return fwd.state_dict(), optim, model
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, optim, model


def diff(a, b):
    """Over b's tensors: max |a - b|, the atol allclose(a, b, rtol=1e-6) needs, and the worst name."""
    worst = []
    for k in b:
        d, ref = (a[k].float() - b[k].float()).abs(), b[k].float().abs()
        worst.append((d.max().item(), (d - 1e-6 * ref).clamp_min(0).max().item(), k))
    top = max(worst, key=lambda t: t[1])
    return {"max": max(w[0] for w in worst), "atol_needed": top[1], "name": top[2]}


STRATEGIES = [("z1", {}), ("z2", {}), ("z3", {}), ("z3-plain", {}), ("engine", {"engine_stage": 0}),
              ("engine", {"engine_stage": 1}), ("engine", {"engine_stage": 2}), ("engine", {"engine_stage": 3})]


def label(strategy, extra):
    return f"engine{extra['engine_stage']}" if strategy == "engine" else strategy


# ---------------------------------------------------------------------------- param groups, schedulers
def param_groups_vs_torch(comm, torch_group):
    """nanoGPT's two AdamW groups on every strategy vs torch DDP with the same groups (TinyGPT, and the
    edge model for a tight tolerance); a StepLR on every optimizer (the engine has its own schedules)."""
    out = {}
    adamw = (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95)})
    for name in ("tiny-gpt", "edge"):
        make = lambda: build_model(name, seed=0, **(GPT if name == "tiny-gpt" else {}))  # noqa: E731
        batches = global_batches(make(), STEPS, BATCH)
        groups = lambda m: nanogpt_groups(m, 0.1)  # noqa: E731
        ref = {sched: train(comm, torch_group, "torch", make, adamw, batches, groups, schedule=sched)[0]
               for sched in (True, False)}
        # the control: every tensor in one decayed group, how far a lost no-decay group lands
        one = train(comm, torch_group, "torch", make, (torch.optim.AdamW, {**adamw[1], "weight_decay": 0.1}),
                    batches, schedule=True)[0]
        out[f"{name}/one_group_vs_torch"] = diff(one, ref[True])
        for strategy, extra in STRATEGIES:
            sched = strategy != "engine"
            got, optim, _ = train(comm, torch_group, strategy, make, adamw, batches, groups, schedule=sched, **extra)
            out[f"{name}/{label(strategy, extra)}"] = diff(got, ref[sched])
            out[f"{name}/{label(strategy, extra)}/lr"] = [g["lr"] for g in optim.param_groups] if sched else None
    return out


def _zero(strategy, model, comm, groups):
    """(the module to call, the optimizer) of ZeRO-`strategy` with param groups of the plain model."""
    if strategy == "z1":
        return model, ShardedOptimizer(groups, torch.optim.AdamW, comm, lr=1e-2)
    if strategy == "z2":
        wrapped = ShardGradOp(model, torch.optim.AdamW, comm, params=groups, lr=1e-2)
        return wrapped, wrapped.optim
    wrapped = FSDP(model, comm)
    return wrapped, FSDPOptimizer(wrapped, torch.optim.AdamW, groups, lr=1e-2)


def state_dict_round_trip(comm):
    """Train 2 steps, save the optimizer's state_dict (through torch.save), load it into a fresh model
    and optimizer of the same layout, train 2 more on both: bitwise equal. Plus the refusals."""
    import io
    out = {}
    batches = global_batches(build_model("edge"), 4, BATCH)
    for strategy in ("z1", "z2", "z3"):
        finals = []
        for resume in (False, True):
            model = build_model("edge", seed=0)
            wrapped, optim = _zero(strategy, model, comm, nanogpt_groups(model, 0.1))
            for s, batch in enumerate(batches):
                if resume and s == 2:  # a fresh copy of everything, from the saved state dicts
                    weights, buf = wrapped.state_dict(), io.BytesIO()
                    torch.save(optim.local_state_dict(), buf)  # this rank's shard
                    model = build_model("edge", seed=1)  # other weights: loading must overwrite them
                    wrapped, optim = _zero(strategy, model, comm, nanogpt_groups(model, 0.1))
                    wrapped.load_state_dict(weights)
                    buf.seek(0)
                    optim.load_state_dict(torch.load(buf, weights_only=False))
                wrapped(*shard(batch, comm.rank, comm.size))[1].backward()
                (wrapped if strategy == "z2" else optim).step()
                (wrapped if strategy == "z2" else optim).zero_grad()
            finals.append(wrapped.state_dict())
        out[f"{strategy}/resumed_bitwise"] = all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    fsdp = FSDP(build_model("edge", seed=0), comm)
    trainable = [p for p in fsdp.parameters() if p.requires_grad]
    out["err/overlap"] = _error(lambda: FSDPOptimizer(fsdp, torch.optim.AdamW, [
        {"params": trainable}, {"params": trainable[:1]}], lr=0.1))
    opt = FSDPOptimizer(fsdp, torch.optim.AdamW, lr=0.1)
    out["err/add_group"] = _error(lambda: opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]}))
    sd = opt.state_dict()
    sd["layout"] = {**sd["layout"], "rank": (comm.rank + 1) % comm.size}
    out["err/other_rank"] = _error(lambda: opt.load_state_dict(sd))
    return out


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001  the message is what the test reads
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------- parameters without a gradient
def grad_none_vs_torch(comm, torch_group):
    """Branchy (branch used in the first steps only, `unused` never) and the edge model (`unused`
    never): AdamW with weight decay and SGD with momentum, every strategy vs torch DDP."""
    out = {}

    def toggle(model, step):
        model.use_branch = step < Branchy.BRANCH_STEPS

    cases = (("branchy", Branchy, regression(STEPS, BATCH), toggle),
             ("edge", lambda: build_model("edge", seed=0), global_batches(build_model("edge"), STEPS, BATCH), None))
    for name, make, batches, before in cases:
        init = {k: v.detach().clone() for k, v in make().state_dict().items()}
        for opt_name, opt in (("adamw", (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01})),
                              ("sgd", (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))):
            ref = train(comm, torch_group, "torch", make, opt, batches, before_step=before)[0]
            out[f"{name}/{opt_name}/torch/unused_moved"] = diff(ref, {"unused": init["unused"]})["max"]
            # engine stage 0 steps torch's own optimizer; z3-plain too (groups_vs_torch covers both)
            for strategy, extra in STRATEGIES[:3] + STRATEGIES[5:]:
                got = train(comm, torch_group, strategy, make, opt, batches, before_step=before, **extra)[0]
                key = f"{name}/{opt_name}/{label(strategy, extra)}"
                out[key] = diff(got, ref)
                out[key + "/unused_bitwise"] = bool(torch.equal(got["unused"], ref["unused"]))
    return out


def checkpoints_across_stages(comm, ckpt_dir):
    """The edge model under AdamW with weight decay: `unused` never gets a gradient, so torch keeps no
    state for it. Save at stage s after 2 steps, load at every stage t, train 2 more: equal to stage
    s going on by itself. A stage-0 optimizer after loading holds no state for `unused`."""
    import os
    out = {}
    batches = global_batches(build_model("edge"), 4, BATCH)

    def engine(stage):
        return build_engine(build_model("edge", seed=0),
                          {"train_micro_batch_size_per_gpu": BATCH // comm.size, "gradient_clipping": 0.0,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                           "zero_optimization": {"stage": stage}}, comm)

    def steps(e, part):
        for batch in part:
            e.backward(e(*shard(batch, comm.rank, comm.size)))
            e.step()

    for src in (0, 1, 3):
        e = engine(src)
        steps(e, batches[:2])
        path = os.path.join(ckpt_dir, f"stage{src}")
        e.save_checkpoint(path)
        steps(e, batches[2:])
        ref = e.full_state_dict()
        for dst in range(4):
            e2 = engine(dst)
            err = _error(lambda: e2.load_checkpoint(path))
            out[f"{src}->{dst}/error"] = err
            if err:
                continue
            if dst == 0:
                unused = e2.module.unused
                out[f"{src}->0/unused_has_state"] = unused in e2.optimizer.state
            steps(e2, batches[2:])
            out[f"{src}->{dst}"] = diff(e2.full_state_dict(), ref)
    return out


# ---------------------------------------------------------------------------- buffers
def buffers_vs_torch(comm, torch_group):
    """BatchNorm's running statistics: rank 0's are broadcast before each training forward (as torch
    DDP's broadcast_buffers=True), so every rank starts each forward from the same statistics and
    ends where torch DDP's same rank does. Off: they drift apart."""
    out = {}
    sgd = (torch.optim.SGD, {"lr": 0.1})
    batches = regression(STEPS, BATCH)

    seen = []

    def snapshot(model):
        seen.clear()
        model.bn.register_forward_pre_hook(lambda m, a: seen.append(torch.cat([m.running_mean, m.running_var]).clone()))

    def spread():
        mine = torch.stack(seen)
        theirs = comm.allgather_object(mine)
        return max((t - theirs[0]).abs().max().item() for t in theirs)

    train(comm, torch_group, "torch", Norm, sgd, batches, hook=snapshot)
    ref = {"stats": torch.stack(seen)}  # the statistics each of torch DDP's forwards started from
    out["torch/spread"] = spread()
    for key, strategy, extra in (("ddp", "ddp", {}), ("ddp-off", "ddp", {"broadcast_buffers": False}),
                                 ("z2", "z2", {}), ("z3", "z3", {}), ("engine1", "engine", {"engine_stage": 1}),
                                 ("engine3", "engine", {"engine_stage": 3})):
        comm.stats.reset()
        train(comm, torch_group, strategy, Norm, sgd, batches, hook=snapshot, **extra)
        out[f"{key}/broadcast_sent"] = comm.stats.sent("broadcast")
        out[f"{key}/spread"] = spread()
        out[f"{key}/vs_torch"] = diff({"stats": torch.stack(seen)}, ref)  # this rank's, forward by forward
    out["buffer_bytes"] = sum(b.numel() * b.element_size() for b in Norm().buffers())
    return out


# ---------------------------------------------------------------------------- FSDP's parameters
class Shapey(nn.Linear):
    """A layer whose repr reads its weight's shape, as many user layers do."""

    def extra_repr(self):
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}"


def fsdp_parameters(comm):
    model = build_model("edge", seed=0)
    model.fc1 = Shapey(5, 13)
    plain = {n: tuple(p.shape) for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    fsdp = FSDP(model, comm, wrap=(nn.Linear,))
    named = [(n, tuple(p.shape), tuple(getattr(p, "full_shape", p.shape)), p.numel(), p.requires_grad)
             for n, p in fsdp.named_parameters()]
    out = {"plain": plain, "named": named, "module_names": [n for n, _ in fsdp.module.named_parameters()],
           "state_dict_keys": list(fsdp.state_dict()) == keys, "tied_names": [n for n, _ in
                                                                             fsdp.named_parameters(remove_duplicate=False)],
           "local_numel": sum(p.numel() for p in fsdp.parameters() if p.requires_grad),
           "is_module_weight": fsdp.module.fc2.weight.shape == (5, 13)}
    out["repr"] = _error(lambda: str(fsdp)) or str(fsdp)
    opt = FSDPOptimizer(fsdp, torch.optim.SGD, lr=0.1)
    x, y = shard(global_batches(model, 1, BATCH)[0], comm.rank, comm.size)
    fsdp(x, y)[1].backward()
    out["grads"] = {n: (None if p.grad is None else tuple(p.grad.shape)) for n, p in fsdp.named_parameters()}
    opt.step()
    out["repr_after_step"] = str(fsdp) == out["repr"]
    return out


def offload_one_group(comm):
    """The engine with offload_optimizer cpu at stages 1-3, one param group with its OWN lr (0.05, the
    config says 0.1) and WarmupCosineLR (ratios of each group's lr): the host optimizer must step with
    the group's scheduled lr, so the parameters equal the same engine without offload. The control
    (stage 1): a host optimizer cut off from the group, as if the scheduler never reached it."""
    out = {}
    for stage, variants in ((1, ("none", "cpu", "cut")), (2, ("none", "cpu")), (3, ("none", "cpu"))):
        states = []
        for variant in variants:
            model = build_model("mlp", seed=0)
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                   "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                   "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 4, "warmup_num_steps": 2}},
                   "zero_optimization": {"stage": stage,
                                         "offload_optimizer": {"device": "none" if variant == "none" else "cpu"}}}
            engine = build_engine(model, cfg, comm, model_parameters=[{"params": list(model.parameters()), "lr": 0.05}])
            if variant == "cut":
                engine.offload.param_groups = [{k: v for k, v in g.items() if k != "params"}
                                               for g in engine.offload.optim.param_groups]
            for s in range(3):
                x, y = shard(regression_batch(s, 2 * comm.size, 16, 4), comm.rank, comm.size)
                engine.backward(engine(x, y))
                engine.step()
            states.append(engine.full_state_dict())
        for variant, state in zip(variants[1:], states[1:]):
            out[f"{stage}/{variant}"] = {"bitwise": all(torch.equal(states[0][k], state[k]) for k in state),
                                         "max": max((states[0][k] - state[k]).abs().max().item() for k in state)}
    return out


def run_all(comm, ckpt_dir):
    from minizero_course.experiments import sleepy_barrier
    init_torch_distributed(torch.device("cpu"))  # torch DDP, the ground truth, needs torch.distributed
    group3 = dist.new_group([0, 1, 2])           # every rank takes part in creating it
    sub3 = comm.split(0 if comm.rank < 3 else 1, name="first3")
    out, t0 = {"seconds": {}}, time.perf_counter()
    if comm.rank < 3:
        for key, fn, args in (("groups", param_groups_vs_torch, (group3,)),
                              ("grad_none", grad_none_vs_torch, (group3,)),
                              ("checkpoints", checkpoints_across_stages, (ckpt_dir,)),
                              ("buffers", buffers_vs_torch, (group3,)), ("state_dict", state_dict_round_trip, ()),
                              ("fsdp", fsdp_parameters, ())):
            out[f"3/{key}"] = fn(sub3, *args)
            out["seconds"][key] = round(time.perf_counter() - t0, 1)
    sleepy_barrier()
    out["4/grad_none"] = grad_none_vs_torch(comm, None)
    out["seconds"]["4/grad_none"] = round(time.perf_counter() - t0, 1)
    out["4/offload"] = offload_one_group(comm)
    out["seconds"]["4/offload"] = round(time.perf_counter() - t0, 1)
    return out
