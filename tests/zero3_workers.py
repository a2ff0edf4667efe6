"""What the ZeRO-3 tests (and lesson 06) run on N ranks through minizero.launch.

One job per N does everything (a launch costs seconds): FSDP, our DDP and the single-process
baseline on both models with SGD and Adam, plus prefetch off, persistence, bf16 and the API
checks. Every number returned is measured: parameters from gather_full_params, bytes from
comm.stats, memory from memory.measure and memory.transient, liveness from weakrefs."""
import time
import weakref

import torch
import torch.nn as nn

from minizero import memory
from minizero_course.experiments.references import train_single
from minizero.data import shard
from minizero.dp.ddp import DDP
from minizero.models import build_model
from minizero_course.experiments.references import flat_params, global_batches, make_optimizer
from minizero.zero.fsdp import FSDP
from minizero.zero.fsdp_optimizer import FSDPOptimizer

torch.set_num_threads(1)

# The DDP tests' models: a tied GPT (root unit = wte/wpe/ln_f, one unit per block) and the
# edge model with every Linear wrapped, so the tied emb<->head weight spans two wrapped
# modules and must land in the root unit once, and the frozen Linear makes an empty unit.
GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
MODELS = {"tiny-gpt": (GPT, None), "edge": ({}, (nn.Linear,))}
LR = {"sgd": 0.1, "adam": 1e-2}
STEPS, BATCH = 5, 12  # 12 divides over 1, 2, 3 and 4 ranks


def _compare(a, b):
    d = (a - b).abs()
    return {"max_abs": d.max().item(), "atol_needed": (d - 1e-6 * b.abs()).clamp_min(0).max().item(),
            "bitwise": bool(torch.equal(a, b))}


def _full_vector(full, model):
    """gather_full_params() laid out like flat_params(model) (each Parameter once, module order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return torch.cat([full[names[id(p)]].reshape(-1) for p in model.parameters()])


def train_fsdp(comm, name, opt_name="sgd", steps=STEPS, batch=BATCH, **kw):
    """Train FSDP; per step: bytes by op, ledger after forward/backward/step, transient peak."""
    cfg, wrap = MODELS[name]
    model = build_model(name, seed=0, **cfg)
    originals = [weakref.ref(p) for p in model.parameters()]
    fsdp = FSDP(model, comm, wrap=wrap, **kw)
    cls, kw = (torch.optim.SGD, {"momentum": 0.9}) if opt_name == "sgd" else (torch.optim.Adam, {})
    opt = FSDPOptimizer(fsdp, cls, lr=LR[opt_name], **kw)  # make_optimizer's, on the flat shards
    gathered = []  # weakrefs to every forward-gathered buffer: are they really freed?
    for u in fsdp.units:  # registered after FSDP's own pre-hook, so u.buf is gathered here
        u.module.register_forward_pre_hook(lambda m, a, u=u: gathered.append(weakref.ref(u.buf)))
    # the originals live on as the local parts (use_orig_params), their storage a unit's shard or whole:
    # count those that still hold storage of their own (full-size memory); the frozen ones do
    unit_storages = {t.untyped_storage().data_ptr() for u in fsdp.units for t in (u.shard, u.whole) if t is not None}
    out = {"originals_alive": sum(r() is not None and r().untyped_storage().data_ptr() not in unit_storages
                                  for r in originals)}
    out.update({k: [] for k in ("sent", "losses", "peak", "after_forward", "after_backward", "after_step",
                           "alive_after_forward", "live_after_step", "seconds")})
    fsdp.counters.update(gathers=0, prefetch_hits=0)
    for b in global_batches(model, steps, batch):
        comm.stats.reset()
        memory.transient.reset()
        gathered.clear()
        t0 = time.perf_counter()
        loss = fsdp(*shard(b, comm.rank, comm.size))[1]
        out["after_forward"].append(memory.measure(fsdp).by_category)
        out["alive_after_forward"].append(sum(r() is not None for r in gathered))
        loss.backward()
        out["after_backward"].append(memory.measure(fsdp).by_category)
        out["peak"].append(memory.transient.peak)
        out["sent"].append({op: s["sent_bytes"] for op, s in comm.stats.as_dict().items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["seconds"].append(time.perf_counter() - t0)
        out["after_step"].append(memory.measure(fsdp, opt).by_category)
        out["live_after_step"].append(memory.transient.current)
        loss = loss.detach().clone()
        comm.all_reduce(loss, op="avg")
        out["losses"].append(loss.item())
    comm.stats.reset()
    full = fsdp.gather_full_params()
    out["gather_full_sent"] = comm.stats.sent()
    out["counters"] = dict(fsdp.counters)
    out["units"] = [{"name": u.name, "numel": u.layout.numel, "padded": u.gathered_numel, "whole": u.persistent_numel}
                    for u in fsdp.units]
    out["events"] = [(what, unit) for _, what, unit in fsdp.events]
    out["keys"] = list(full)
    plain = build_model(name, seed=0, **cfg)
    names = dict(plain.named_parameters(remove_duplicate=False))
    out["plain_param_keys"] = [k for k in plain.state_dict() if k in names]
    plain.load_state_dict(fsdp.state_dict())  # strict: every key, tied ones too
    out["loads_into_plain"] = torch.equal(flat_params(plain), _full_vector(full, plain))
    return _full_vector(full, plain), out


def train_ddp(comm, name, opt_name):
    cfg, _ = MODELS[name]
    model = build_model(name, seed=0, **cfg)
    ddp = DDP(model, comm)
    opt = make_optimizer(opt_name, model.parameters(), LR[opt_name])
    sent, ledger = [], None
    for b in global_batches(model, STEPS, BATCH):
        comm.stats.reset()
        ddp(*shard(b, comm.rank, comm.size))[1].backward()
        ddp.finish_gradient_synchronization()
        sent.append(comm.stats.sent())
        opt.step()
        opt.zero_grad(set_to_none=True)
        ledger = memory.measure(ddp, opt).by_category
    return flat_params(model), {"sent": sent, "after_step": ledger}


def run_all(comm):
    out = {"timing": []}
    t0 = time.perf_counter()
    tick = lambda what: out["timing"].append((what, round(time.perf_counter() - t0, 2)))  # noqa: E731
    for name in MODELS:
        cfg, _ = MODELS[name]
        for opt_name in LR:
            key = f"{name}/{opt_name}"
            z3, facts = train_fsdp(comm, name, opt_name)
            tick(key + " z3")
            ddp, dfacts = train_ddp(comm, name, opt_name)
            tick(key + " ddp")
            out[key] = facts
            out[f"{key}/ddp"] = dfacts
            out[f"{key}/vs_ddp"] = _compare(z3, ddp)
            if comm.rank == 0:
                model = build_model(name, seed=0, **cfg)
                train_single(model, make_optimizer(opt_name, model.parameters(), LR[opt_name]),
                             global_batches(model, STEPS, BATCH))
                out[f"{key}/vs_single"] = _compare(z3, flat_params(model))
            tick(key + " single")
            if opt_name == "sgd":  # the same numbers with prefetch off, and with persistence
                z3_np, out[f"{key}/no_prefetch"] = train_fsdp(comm, name, opt_name, prefetch=False)
                out[f"{key}/no_prefetch/same_bits"] = torch.equal(z3_np, z3)
                z3_p, out[f"{key}/persist"] = train_fsdp(comm, name, opt_name, persistence_threshold=PERSIST[name])
                out[f"{key}/persist/vs_z3"] = _compare(z3_p, z3)
                tick(key + " np+persist")
    _, out["tiny-gpt/sgd/bf16"] = train_fsdp(comm, "tiny-gpt", "sgd", compute_dtype=torch.bfloat16)
    tick("bf16")
    out.update(api_checks(comm))
    tick("api")
    return out


# Parameters below this many elements stay whole: the GPT's LayerNorms and biases (32, 96 and
# 128 elements), and the edge model's fc biases and its unused 2x3 parameter.
PERSIST = {"tiny-gpt": 129, "edge": 14}


def api_checks(comm):
    out = {}
    # 1. debug=True: ranks that built different weights are told which parameter differs.
    try:
        FSDP(build_model("edge", seed=comm.rank), comm, debug=True)
        out["debug_differs"] = "no error"
    except ValueError as e:
        out["debug_differs"] = str(e)
    FSDP(build_model("edge", seed=0), comm, debug=True)  # the same weights pass
    # 2. Wrapping twice, or wrapping the module inside an FSDP again.
    model = build_model("edge", seed=0)
    fsdp = FSDP(model, comm)
    for label, target in (("wrap_fsdp", fsdp), ("wrap_inner", model)):
        try:
            FSDP(target, comm)
            out[label] = "no error"
        except ValueError as e:
            out[label] = str(e)
    # 3. Buffers: broadcast from rank 0 at construction, like DDP.
    model = build_model("edge", seed=0)
    model.scale.add_(comm.rank)
    FSDP(model, comm)
    out["buffer_from_rank0"] = torch.equal(model.scale, build_model("edge", seed=0).scale)
    # 4. Gradient accumulation: two half-loss backwards == one backward on both halves.
    grads = []
    for micro in (1, 2):
        fsdp = FSDP(build_model("tiny-gpt", seed=0, **GPT), comm)
        # 24 rows: an even number per rank at N = 1..4, so the two halves are equal
        x, y = shard(global_batches(fsdp.module, 1, 24)[0], comm.rank, comm.size)
        for part in range(micro):
            rows = slice(part * len(x) // micro, (part + 1) * len(x) // micro)
            (fsdp(x[rows], y[rows])[1] / micro).backward()
        grads.append(torch.cat([p.grad for p in fsdp.parameters() if p.grad is not None]))
    out["accumulation"] = _compare(grads[1], grads[0])
    return out
