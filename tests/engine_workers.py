"""What tests/test_engine.py runs through minizero.launch (never inside pytest).

One 2-rank job: for each ZeRO stage, the engine against (a) the building block driven by hand
with the same settings, which must be BITWISE equal (same collectives in the same order, same
float operations), (b) one process on the full batch with the same accumulation and torch's
clip_grad_norm_, (c) itself with one double micro-batch instead of two accumulated ones; then
bytes per step and the ledger, and fp16's overflow streak. Everything returned is measured."""
from contextlib import nullcontext

import torch

from minizero import memory
from minizero.data import SyntheticTokens, shard
from minizero.runtime.engine import build_engine, optimizer_spec
from minizero.models import build_model
from minizero.precision import MinLossScaleError, clip_grad_norm_

torch.set_num_threads(1)

GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
STEPS, MICRO, ACC = 4, 2, 2  # micro-batch per rank; a global micro-batch is MICRO * N rows
# stage 3 with DeepSpeed's default threshold (1e5) would keep every tensor of this small model
# whole; 100 shards the matrices and keeps the small vectors whole: both kinds are exercised.
PERSIST = 100
OPT = {"sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
       "adam": {"type": "Adam", "params": {"lr": 1e-2}}}


def config(stage, opt="sgd", acc=ACC, micro=MICRO, clip=0.0, **extra):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": acc,
            "gradient_clipping": clip, "optimizer": OPT[opt],
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": PERSIST}, **extra}


def batch(step, rows):
    return SyntheticTokens(GPT["vocab_size"], GPT["block_size"]).batch(step, rows)


def flat(sd):
    return torch.cat([v.detach().reshape(-1).float() for v in sd.values()])


def compare(a, b):
    d = (a - b).abs()
    return {"max_abs": d.max().item(), "atol_needed": (d - 1e-6 * b.abs()).clamp_min(0).max().item(),
            "bitwise": bool(torch.equal(a, b))}


def run_engine(comm, cfg, steps=STEPS, double=False):
    """The DeepSpeed loop. double: one micro-batch of 2*MICRO rows = this rank's rows of two."""
    comm.stats.reset()
    engine = build_engine(build_model("tiny-gpt", seed=0, **GPT), cfg, comm)
    startup = comm.stats.as_dict()  # what building the engine sent: rank 0's model, once
    n, acc, micro = comm.size, engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    losses, norms, sent = [], [], []
    for step in range(steps):
        comm.stats.reset()
        for i in range(acc):
            if double:
                parts = [shard(batch(2 * step + j, MICRO * n), comm.rank, n) for j in range(2)]
                x, y = (torch.cat(t) for t in zip(*parts))
            else:
                x, y = shard(batch(step * acc + i, micro * n), comm.rank, n)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        sent.append(comm.stats.sent())
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    by_op = {k: v["sent_bytes"] for k, v in engine.comm_stats().items()}  # the last step's
    return engine, {"losses": losses, "norms": norms, "sent": sent, "by_op": by_op,
                    "startup": startup}


def by_hand(comm, stage, opt, clip=0.0, steps=STEPS):
    """The same training with the building block itself, the way its docstring says to use it."""
    from minizero.dp.ddp import DDP
    from minizero.zero.sharded_optimizer import ShardedOptimizer
    from minizero.zero.shard_grad_op import ShardGradOp
    from minizero.zero.fsdp import FSDP
    from minizero.zero.fsdp_optimizer import FSDPOptimizer
    cls, kw = optimizer_spec(OPT[opt])
    model, n = build_model("tiny-gpt", seed=0, **GPT), comm.size
    fwd = model
    if stage == 0:
        fwd = DDP(model, comm, bucket_numel=int(5e8), overlap=False)
        optim = cls(fwd.params, **kw)
    elif stage == 1:
        optim = ShardedOptimizer(model.parameters(), cls, comm, **kw)
    elif stage == 2:
        fwd = optim = ShardGradOp(model, cls, comm, bucket_numel=int(5e8), overlap=False, **kw)
    else:
        fwd = FSDP(model, comm, prefetch=True, persistence_threshold=PERSIST)
        optim = FSDPOptimizer(fwd, cls, **kw)
    for step in range(steps):
        comm.stats.reset()
        for i in range(ACC):
            x, y = shard(batch(step * ACC + i, MICRO * n), comm.rank, n)
            quiet = stage == 0 and i < ACC - 1
            with fwd.no_sync() if quiet else nullcontext():
                (fwd(x, y)[1] / ACC).backward()
        if stage == 0:
            fwd.finish_gradient_synchronization()
            if clip:
                clip_grad_norm_([p.grad for p in fwd.params if p.grad is not None], clip)
        elif stage in (1, 2) and clip:
            optim.clip_grad_norm_(clip)
        elif stage == 3 and clip:  # shards: squares summed over ranks; whole tensors: once
            sharded = [fwd.unit_grad(u, "shard") for u in fwd.units if u.shard is not None]
            whole = [fwd.unit_grad(u, "whole") for u in fwd.units if u.whole is not None]
            sq = torch.zeros(1)
            for g in sharded:
                sq += g.pow(2).sum()
            comm.all_reduce(sq)
            for g in whole:
                sq += g.pow(2).sum()
            coef = (clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)
            for g in sharded + whole:
                g.mul_(coef)
        optim.step()
        optim.zero_grad(set_to_none=True) if stage in (0, 3) else optim.zero_grad()
    sent = comm.stats.sent()
    return flat(fwd.state_dict() if stage == 3 else model.state_dict()), sent


def single(comm, opt, clip=0.0, steps=STEPS):
    """One process, the full global batch of every micro-step, loss / ACC, torch's clipping."""
    cls, kw = optimizer_spec(OPT[opt])
    model = build_model("tiny-gpt", seed=0, **GPT)
    optim, norms = cls(model.parameters(), **kw), []
    for step in range(steps):
        for i in range(ACC):
            (model(*batch(step * ACC + i, MICRO * comm.size))[1] / ACC).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optim.step()
        optim.zero_grad(set_to_none=True)
    return flat(model.state_dict()), norms


def correctness(comm, configs=(), out_dir=None):
    out, clip = {}, 0.5
    ref = {"sgd": single(comm, "sgd", clip), "adam": single(comm, "adam")}
    out["single/norms"] = ref["sgd"][1]
    for stage in range(4):
        for opt, c in (("sgd", clip), ("adam", 0.0)):
            engine, facts = run_engine(comm, config(stage, opt, clip=c))
            params = flat(engine.full_state_dict())
            hand, hand_sent = by_hand(comm, stage, opt, c)
            out[f"{stage}/{opt}/vs_hand"] = compare(params, hand)
            out[f"{stage}/{opt}/sent_vs_hand"] = [facts["sent"][-1], hand_sent]
            out[f"{stage}/{opt}/vs_single"] = compare(params, ref[opt][0])
            out[f"{stage}/{opt}/norms"] = facts["norms"]
            if opt == "sgd":
                out[f"{stage}/sent"] = facts["sent"][-1]
                out[f"{stage}/sent_by_op"] = facts["by_op"]
                out[f"{stage}/startup"] = facts["startup"]
                out[f"{stage}/ledger"] = engine.memory().by_category
                # accumulation: two micro-batches of MICRO rows == one of 2*MICRO rows (clipped alike)
                twin, _ = run_engine(comm, config(stage, acc=1, micro=2 * MICRO, clip=c), double=True)
                out[f"{stage}/accumulation"] = compare(params, flat(twin.full_state_dict()))
    out.update(overflow_streak(comm))
    out.update(example_configs(comm, configs, out_dir))
    return out


def example_configs(comm, configs, out_dir):
    """Each shipped config trains TinyGPT for 3 steps through the train command's loop."""
    import os

    from minizero.cli.train import train
    out = {}
    for path in configs:
        name = os.path.splitext(os.path.basename(path))[0]
        res = train(comm, path, steps=5, out=os.path.join(out_dir, name), progress=False)
        out[f"config/{name}"] = [r["loss"] for r in res["records"]]
    return out


def overflow_streak(comm):
    """fp16: every step overflows (rank 1's loss is inf): the scale halves to min_loss_scale, the
    weights, lr and scheduler stay put, global_steps advances, then MinLossScaleError."""
    cfg = config(1, "adam", acc=1, fp16={"enabled": True, "initial_scale_power": 3, "hysteresis": 1,
                                          "min_loss_scale": 1},
                 scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 10}})
    engine = build_engine(build_model("tiny-gpt", seed=0, **GPT), cfg, comm)
    before = flat(engine.full_state_dict())
    out = {"scales": [], "lrs": [], "global_steps": [], "error": None}
    x, y = shard(batch(0, MICRO * comm.size), comm.rank, comm.size)
    for _ in range(10):
        out["scales"].append(engine.loss_scale)
        loss = engine(x, y)
        try:
            engine.backward(loss * float("inf") if comm.rank == 1 else loss)
            engine.step()
        except MinLossScaleError as e:
            out["error"] = str(e)
            break
        out["lrs"].append(engine.lr)
        out["global_steps"].append(engine.global_steps)
    out["skipped"] = engine.skipped_steps
    out["params_unchanged"] = bool(torch.equal(before, flat(engine.full_state_dict())))
    memory.transient.reset()
    return {f"overflow/{k}": v for k, v in out.items()}


def correctness_n3(comm):
    """At 3 ranks (shards cut through tensors at other places, padding), SGD with clipping only."""
    out, clip = {}, 0.5
    ref = single(comm, "sgd", clip)[0] if comm.rank == 0 else None
    for stage in range(4):
        engine, _ = run_engine(comm, config(stage, "sgd", clip=clip))
        params = flat(engine.full_state_dict())
        out[f"{stage}/vs_hand"] = compare(params, by_hand(comm, stage, "sgd", clip)[0])
        if comm.rank == 0:
            out[f"{stage}/vs_single"] = compare(params, ref)
    return out
