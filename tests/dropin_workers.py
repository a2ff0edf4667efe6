"""The torch / nanoGPT / DeepSpeed idioms a user brings, on 2 ranks (tests/test_dropin.py, ONE job).

Each function returns numbers the test compares; the ground truth is computed in the same job: torch's
clip on the averaged full gradients, the same training with no_sync(), rank 0's freshly built model.
"""
import argparse
import json
import warnings

import torch
import torch.nn as nn

import minizero
from minizero.dp.ddp import DDP
from minizero.models import build_model
from minizero.runtime.config import ConfigError
from minizero.zero import FSDP, ShardedOptimizer, ShardGradOp

GPT = {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 32, "block_size": 8}


def batch(comm, step, micro=0):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + comm.rank)
    data = torch.randint(GPT["vocab_size"], (2, GPT["block_size"] + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def error_of(fn):
    try:
        fn()
    except (RuntimeError, ValueError, TypeError, AttributeError, ConfigError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def flat_grads(params):
    return torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])


def ddp_idioms(comm):
    """require_backward_grad_sync = False is no_sync(); step before finish is refused; clip_grad_norm_."""
    out = {}
    grads = {}
    for how in ("no_sync", "attribute"):
        model = DDP(build_model("tiny-gpt", seed=0, **GPT), comm)
        for micro in range(2):
            x, y = batch(comm, 0, micro)
            if how == "no_sync" and micro == 0:
                with model.no_sync():
                    model(x, y)[1].backward()
            else:
                model.require_backward_grad_sync = micro == 1  # nanoGPT's line
                model(x, y)[1].backward()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out[f"{how}/step_before_finish"] = error_of(opt.step)
        model.finish_gradient_synchronization()
        grads[how] = flat_grads(model.module.parameters()).clone()
        reference = grads[how].norm()  # the averaged gradient's norm, before clipping
        norm = model.clip_grad_norm_(0.01)
        out[f"{how}/norm"] = [norm.item(), reference.item()]
        out[f"{how}/clipped_norm"] = flat_grads(model.module.parameters()).norm().item()
    out["attribute_vs_no_sync"] = (grads["attribute"] - grads["no_sync"]).abs().max().item()
    return out


def zero2_inner_optimizer(comm):
    """model.optim.step() is model.step(); a scheduler on model.optim sees the steps (no warning)."""
    out = {}
    params = {}
    for how in ("wrapper", "inner"):
        model = ShardGradOp(build_model("tiny-gpt", seed=0, **GPT), torch.optim.AdamW, comm, lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(model.optim, 1, 0.5)
        out[f"{how}/before_backward"] = error_of(model.optim.step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                x, y = batch(comm, step)
                model(x, y)[1].backward()
                (model.step if how == "wrapper" else model.optim.step)()
                sched.step()
                (model.zero_grad if how == "wrapper" else model.optim.zero_grad)()
        out[f"{how}/warnings"] = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
        out[f"{how}/lr"] = model.optim.param_groups[0]["lr"]
        params[how] = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    out["inner_vs_wrapper"] = (params["inner"] - params["wrapper"]).abs().max().item()
    return out


def fsdp_idioms(comm):
    """Per-rank seeds, an optimizer built before wrapping, 0-element local parts, clip_grad_norm_."""
    out = {}
    reference = build_model("tiny-gpt", seed=0, **GPT)  # rank 0's model, built the same on every rank
    model = build_model("tiny-gpt", seed=comm.rank, **GPT)  # nanoGPT: 1337 + rank
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2)  # built on the raw model, before wrapping
    fsdp = FSDP(model, comm)
    full = fsdp.state_dict()
    out["init_vs_rank0"] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    out["groups_still_trained"] = all(any(p is q for q in fsdp.parameters()) for g in opt.param_groups
                                      for p in g["params"])
    ddp = DDP(reference, comm)
    ddp_opt = torch.optim.AdamW([{"params": [p for p in reference.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in reference.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                lr=1e-2)
    for step in range(2):
        x, y = batch(comm, step)
        fsdp(x, y)[1].backward()
        ddp(x, y)[1].backward()
        ddp.finish_gradient_synchronization()
        if step == 0:
            out["none_grads"] = [n for n, p in fsdp.named_parameters() if p.grad is None]
            out["empty_parts"] = [n for n, p in fsdp.named_parameters() if p.numel() == 0]
            out["norms"] = [fsdp.clip_grad_norm_(0.05).item(), ddp.clip_grad_norm_(0.05).item()]
        opt.step()
        ddp_opt.step()
        opt.zero_grad()
        ddp_opt.zero_grad()
    full = fsdp.state_dict()
    out["trained_vs_ddp"] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    out["require_backward_grad_sync"] = error_of(lambda: setattr(fsdp, "require_backward_grad_sync", False))
    return out


def zero1_buffers(comm):
    """ShardedOptimizer(module=model) keeps BatchNorm's statistics rank 0's; without it each rank its own."""
    out = {}
    for how in ("module", "none"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
        opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, comm, module=model if how == "module" else None,
                               lr=0.1)
        for step in range(2):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step * 10 + comm.rank)) * (1 + comm.rank)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        high, low = model[1].running_mean.clone(), model[1].running_mean.clone()
        comm.all_reduce(high, op="max")
        comm.all_reduce(low, op="min")
        out[f"{how}/spread"] = (high - low).max().item()  # 0: every rank holds rank 0's statistics
    return out


def deepspeed_initialize(comm, tmp_dir):
    """DeepSpeed's call and its 4-tuple; its mistakes, each a clear error before anything runs."""
    out = {}
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    path = f"{tmp_dir}/ds_config_{comm.rank}.json"
    with open(path, "w") as f:
        json.dump(cfg, f)
    args = argparse.Namespace(deepspeed_config=path, local_rank=0)
    data = torch.utils.data.TensorDataset(torch.arange(16))
    engine, optimizer, loader, scheduler = minizero.initialize(args=args, model=build_model("tiny-gpt", seed=0, **GPT),
                                                               training_data=data, comm=comm)
    out["tuple"] = [type(engine).__name__, optimizer is engine.optimizer, scheduler is None]
    out["loader"] = sorted(int(i) for (b,) in loader for i in b)
    out["loader_batch"] = len(next(iter(loader))[0])
    model = build_model("tiny-gpt", seed=0, **GPT)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.05)
    _, optimizer, _, scheduler = minizero.initialize(
        model=model, optimizer=opt, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}},
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5), comm=comm)
    out["client"] = [optimizer.optimizer_cls.__name__, optimizer.param_groups[0]["lr"],
                     optimizer.param_groups[0]["weight_decay"],
                     type(scheduler).__name__]
    fresh = lambda: build_model("tiny-gpt", seed=0, **GPT)  # noqa: E731
    out["errors"] = {
        "positional": error_of(lambda: minizero.initialize(fresh(), cfg, comm=comm)),
        "two_configs": error_of(lambda: minizero.initialize(args=args, model=fresh(), config=cfg, comm=comm)),
        "scheduler_object": error_of(lambda: minizero.initialize(
            model=(m := fresh()), config={"train_micro_batch_size_per_gpu": 2}, comm=comm,
            optimizer=(o := torch.optim.AdamW(m.parameters())), lr_scheduler=torch.optim.lr_scheduler.StepLR(o, 1))),
        "engine_from_tuple": error_of(lambda: minizero.initialize(model=fresh(), config=cfg, comm=comm).backward),
    }
    return out


def offload_groups(comm, tmp_dir):
    """nanoGPT's two groups with their own lr / weight_decay under offload_optimizer cpu (DeepSpeed accepts
    them): stages 1-3 train what the same engine without offload trains, and a checkpoint taken mid-way resumes
    bitwise (the host optimizer's per-group state is saved and loaded by master). SGD with momentum: the
    offloaded step is torch's fused CPU kernel, the same arithmetic, so the comparison can be tight."""
    out = {}

    def engine_for(stage, device, grouped=True):
        model = build_model("tiny-gpt", seed=0, **GPT)
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 0.05}]
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
               "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
               "zero_optimization": {"stage": stage, "offload_optimizer": {"device": device}}}
        return minizero.initialize(model=model, config=cfg, comm=comm,
                                   model_parameters=groups if grouped else None).engine

    def train(engine, steps):
        for step in steps:
            x, y = batch(comm, step)
            engine.backward(engine(x, y))
            engine.step()

    def max_diff(a, b):
        return max((a[k] - b[k]).abs().max().item() for k in a)

    for stage in (1, 2, 3):
        plain, offloaded = engine_for(stage, "none"), engine_for(stage, "cpu")
        train(plain, range(3))
        train(offloaded, range(2))
        offloaded.save_checkpoint(f"{tmp_dir}/offload{stage}")
        train(offloaded, [2])
        resumed = engine_for(stage, "cpu")
        resumed.load_checkpoint(f"{tmp_dir}/offload{stage}")
        train(resumed, [2])
        reference = plain.full_state_dict()
        out[f"{stage}/vs_device"] = max_diff(offloaded.full_state_dict(), reference)
        out[f"{stage}/resumed"] = max_diff(resumed.full_state_dict(), offloaded.full_state_dict())
        out[f"{stage}/groups"] = len(offloaded.offload.optim.param_groups)
        # torch's clip line after backward: the averaged gradient's norm as without offload, or a clear error
        # (a None .grad everywhere would read 0 and clip nothing)
        x, y = batch(comm, 3)
        for engine in (plain, offloaded):
            engine.backward(engine(x, y))
        out[f"{stage}/clip_plain"] = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9).item()
        try:
            out[f"{stage}/clip_offload"] = torch.nn.utils.clip_grad_norm_(offloaded.parameters(), 1e9).item()
        except RuntimeError as e:
            out[f"{stage}/clip_offload"] = str(e)
    one_group = engine_for(1, "cpu", grouped=False)
    train(one_group, range(3))
    out["control"] = max_diff(one_group.full_state_dict(), reference)  # groups ignored would land here
    return out


def torch_clip_and_consolidate(comm, tmp_dir):
    """torch's own clip (its foreach path too) and p.grad's other uses under ZeRO-1/2/3; ZeRO-1's state
    consolidated to rank 0, saved there, loaded on every rank: into a fresh ZeRO-1 and into torch's AdamW."""
    out = {}
    x, y = batch(comm, 0)
    ref = DDP(build_model("tiny-gpt", seed=0, **GPT), comm)
    ref(x, y)[1].backward()
    ref.finish_gradient_synchronization()
    out["reference_norm"] = torch.nn.utils.clip_grad_norm_(ref.module.parameters(), 1e9).item()
    out["reference_inf"] = torch.nn.utils.get_total_norm([p.grad for p in ref.module.parameters()], "inf").item()
    reference = {n: p.grad for n, p in ref.module.named_parameters()}
    for how in ("zero1", "zero2", "zero3"):
        model = build_model("tiny-gpt", seed=0, **GPT)
        if how == "zero1":
            opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, comm, lr=1e-2)
        elif how == "zero2":
            model = ShardGradOp(model, torch.optim.AdamW, comm, lr=1e-2)
        else:
            model = FSDP(model, comm)
        model(x, y)[1].backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        # FSDP2's gather: each parameter's gradient, full shape, on every rank (DTensor.full_tensor)
        full = {n.removeprefix("module."): p.grad.full_tensor() for n, p in model.named_parameters()}
        out[f"{how}/full_tensor_vs_ddp"] = max((full[n] - g).abs().max().item() if full[n].shape == g.shape
                                               else float("inf") for n, g in reference.items())
        out[f"{how}/foreach_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, foreach=True).item()
        out[f"{how}/inf_norm"] = torch.nn.utils.get_total_norm(grads, "inf").item()
        out[f"{how}/norm_over_dim"] = error_of(lambda: grads[0].norm(dim=0))
        out[f"{how}/sum"] = error_of(lambda: grads[0].sum())
        if how == "zero1":  # ZeRO-1: a manual unscale before the clip reaches the reduced shard
            for p in model.parameters():
                p.grad.div_(2.0)
            out["zero1/halved_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
            out["zero1/shard_norm"] = opt.clip_grad_norm_(1e9).item()  # the shard the step uses
    # ZeRO-1's state: consolidated to rank 0, saved there, loaded everywhere (nanoGPT's resume)
    path = f"{tmp_dir}/zero1_optimizer.pt"

    def zero1(seed):
        model = build_model("tiny-gpt", seed=seed, **GPT)
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, comm, lr=1e-2)

    def train(model, opt, steps):
        for step in steps:
            model(*batch(comm, step))[1].backward()
            opt.step()
            opt.zero_grad()

    model, opt = zero1(0)
    train(model, opt, range(2))
    out["before_consolidate"] = error_of(opt.state_dict)
    opt.consolidate_state_dict(to=0)
    out["other_rank"] = error_of(opt.state_dict) if comm.rank == 1 else None
    if comm.rank == 0:
        full = opt.state_dict()
        out["numel"] = sum(v.numel() for st in full["state"].values() for v in st.values() if v.dim())
        torch.save({"model": model.state_dict(), "optimizer": full}, path)
    comm.barrier()
    saved = torch.load(path, weights_only=False)
    resumed, resumed_opt = zero1(1)  # other weights: loading must overwrite them
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    plain = build_model("tiny-gpt", seed=1, **GPT)  # torch's own AdamW takes the consolidated state too
    plain.load_state_dict(saved["model"])
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(saved["optimizer"])
    plain_ddp = DDP(plain, comm)
    train(model, opt, [2])
    out["after_step"] = error_of(opt.state_dict)  # the consolidated state is stale after a step
    train(resumed, resumed_opt, [2])
    plain_ddp(*batch(comm, 2))[1].backward()
    plain_ddp.finish_gradient_synchronization()
    plain_opt.step()
    final = model.state_dict()
    out["resumed_vs_continued"] = max((resumed.state_dict()[k] - v).abs().max().item() for k, v in final.items())
    out["torch_adamw_vs_continued"] = max((plain.state_dict()[k] - v).abs().max().item() for k, v in final.items())
    out["moved"] = max((saved["model"][k] - v).abs().max().item() for k, v in final.items())
    out["model_numel"] = sum(p.numel() for p in model.parameters())
    # bf16 parameters: the fp32 masters travel in the consolidated state too
    models = []
    for seed in (0, 1, 0):
        m = build_model("tiny-gpt", seed=seed, **GPT).to(torch.bfloat16)
        models.append((m, ShardedOptimizer(m.parameters(), torch.optim.AdamW, comm, lr=1e-2)))
    (model, opt), (resumed, resumed_opt), (control, control_opt) = models
    train(model, opt, range(2))
    opt.consolidate_state_dict(to=0)
    if comm.rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    comm.barrier()
    saved = torch.load(path, weights_only=False)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    control.load_state_dict(saved["model"])  # the weights without the optimizer state: Adam restarts
    for m, o in ((model, opt), (resumed, resumed_opt), (control, control_opt)):
        train(m, o, [2, 3])
    final = model.state_dict()
    out["bf16/resumed_vs_continued"] = max((resumed.state_dict()[k] - v).abs().max().item() for k, v in final.items())
    out["bf16/control"] = max((control.state_dict()[k] - v).float().abs().max().item() for k, v in final.items())
    return out


def run_all(comm, tmp_dir):
    return {"ddp": ddp_idioms(comm), "zero2": zero2_inner_optimizer(comm), "fsdp": fsdp_idioms(comm),
            "zero1": zero1_buffers(comm), "initialize": deepspeed_initialize(comm, tmp_dir),
            "offload_groups": offload_groups(comm, tmp_dir), "sharded_grads": torch_clip_and_consolidate(comm, tmp_dir)}
