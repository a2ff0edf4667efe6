"""What tests/test_zero12.py runs through minizero.launch (never inside pytest).

ONE 4-rank job covers N = 4, 3, 2 and 1, on sub-communicators (comm.split): a launch costs
seconds (python, torch, MPI start-up, then torch._dynamo on the first optimizer step), four
of them cost more than all the training. A sub-communicator of n ranks is a real MPI
communicator of n ranks: same algorithms, same byte accounting (comm.size is n).
    N=4: ranks 0-3;   then N=3: ranks 0-2 while N=1: rank 3;   then N=2: ranks 0-1.
Each suite: DDP, ZeRO-1 (alone and after DDP), ZeRO-2 (small buckets, one bucket, no
overlap) on both models with SGD and Adam, the single-process reference, accumulation,
clipping, mixed precision and the error paths. Everything returned is measured here:
parameters, ledger bytes, comm.stats bytes."""
import hashlib

import torch

from minizero import memory
from minizero_course.experiments.references import train_single
from minizero.data import shard
from minizero.dp.ddp import DDP
from minizero.models import build_model
from minizero_course.experiments.references import flat_params, global_batches, make_optimizer
from minizero.zero.sharded_optimizer import ShardedOptimizer
from minizero.zero.shard_grad_op import ShardGradOp
from minizero.zero.sharded_grad import is_placeholder

torch.set_num_threads(1)

GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
MODELS = {"tiny-gpt": GPT, "edge": {}}
LR = {"sgd": 0.1, "adam": 1e-2}
STEPS, BATCH = 5, 12  # 12 divides over 1, 2, 3 and 4 ranks
# Small buckets cut the GPT's 112 KB of gradients into 6 buckets and the edge model's 836 B
# into 5, so buckets straddle shard boundaries and several launch during backward.
SMALL_BUCKET_NUMEL = {"tiny-gpt": 5000, "edge": 50}  # fp32 gradients per bucket
STRATEGIES = ("ddp", "z1", "z1+ddp", "z2", "z2-1bucket", "z2-no-overlap")
# Adam runs skip the two bucket variants: they only change WHEN the same reduces run, which
# SGD already checks, and each run costs time on a 2-core machine.
ADAM_STRATEGIES = ("ddp", "z1", "z1+ddp", "z2")


def _digest(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def _compare(a, b):
    """max |a - b|, and the smallest atol for which allclose(a, b, rtol=1e-6, atol) holds."""
    d = (a - b).abs()
    return {"max_abs": d.max().item(), "atol_needed": (d - 1e-6 * b.abs()).clamp_min(0).max().item()}


def _opt(opt_name):
    return (torch.optim.SGD, {"lr": LR["sgd"], "momentum": 0.9}) if opt_name == "sgd" else \
        (torch.optim.Adam, {"lr": LR["adam"]})


def build(comm, strategy, model, opt_name, bucket_numel=None):
    """-> (thing to call forward on, step(), zero_grad(), objects to measure, zero object)."""
    cls, kw = _opt(opt_name)
    if strategy in ("ddp", "z1+ddp"):
        ddp = DDP(model, comm)
        opt = make_optimizer(opt_name, model.parameters(), kw["lr"]) if strategy == "ddp" else \
            ShardedOptimizer(model.parameters(), cls, comm, gradients_reduced=True, **kw)

        def step():
            ddp.finish_gradient_synchronization()
            opt.step()
        return ddp, step, lambda: opt.zero_grad(set_to_none=True), (ddp, opt), opt
    if strategy == "z1":
        opt = ShardedOptimizer(model.parameters(), cls, comm, **kw)
        return model, opt.step, opt.zero_grad, (model, opt), opt
    z2 = ShardGradOp(model, cls, comm, bucket_numel=bucket_numel or 6_250_000, overlap=strategy != "z2-no-overlap",
                     **kw)
    return z2, z2.step, z2.zero_grad, (z2,), z2


def _train(comm, name, opt_name, strategy):
    model = build_model(name, seed=0, **MODELS[name])
    small = SMALL_BUCKET_NUMEL[name] if strategy in ("z2", "z2-no-overlap") else None
    fwd, step, zero_grad, measured, obj = build(comm, strategy, model, opt_name, small)
    facts = {"sent": [], "sent_by_op": None}
    for batch in global_batches(model, STEPS, BATCH):
        comm.stats.reset()  # per step (the broadcast at construction is not a step's traffic)
        memory.transient.reset()
        loss = fwd(*shard(batch, comm.rank, comm.size))[1]
        loss.backward()
        if strategy.startswith("z2"):
            facts["backward_peak"] = memory.transient.peak  # the buckets' high-water mark
            # a placeholder .grad (one element of storage, for torch's clip line) holds no gradient
            facts["grads_left"] = sum(p.grad is not None and not is_placeholder(p.grad) for p in model.parameters())
        step()
        facts["sent"].append(comm.stats.sent())
        facts["sent_by_op"] = {op: s["sent_bytes"] for op, s in comm.stats.as_dict().items()}
        ledger = memory.measure(*measured).by_category  # after step, before zero_grad
        zero_grad()
    facts["ledger"] = ledger
    if strategy.startswith("z2"):
        facts["bucket_numels"] = [b.hi - b.lo for b in obj.buckets]
        facts["launched_in_hooks"] = obj.launched_in_hooks
    return flat_params(model), facts


def _single(name, opt_name, batches=None, clip=None):
    model = build_model(name, seed=0, **MODELS[name])
    opt = make_optimizer(opt_name, model.parameters(), LR[opt_name])
    if clip is None:
        train_single(model, opt, batches or global_batches(model, STEPS, BATCH))
        return flat_params(model), None
    norms = []
    for batch in batches:
        model(*batch)[1].backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return flat_params(model), norms


def run_all(comm):
    """{"4": suite result, "3" or "1": ..., "2": ...} on each rank (keys of the groups it was in)."""
    comm.require_size(4, "the test schedule puts N = 4, 3, 1 and 2 on sub-groups of 4 ranks")
    out = {"4": suite(comm)}
    three_or_one = comm.split(0 if comm.rank < 3 else 1, name="n3" if comm.rank < 3 else "n1")
    out[str(three_or_one.size)] = suite(three_or_one)
    pairs = comm.split(comm.rank // 2, name=f"pair{comm.rank // 2}")
    if comm.rank < 2:  # ranks 2 and 3 would only repeat it: leave the cores to 0 and 1
        out["2"] = suite(pairs)
    return out


def suite(comm):
    out = {}
    for name in MODELS:
        for opt_name in LR:
            key = f"{name}/{opt_name}"
            runs = {}
            for strategy in STRATEGIES if opt_name == "sgd" else ADAM_STRATEGIES:
                params, facts = _train(comm, name, opt_name, strategy)
                runs[strategy] = params
                out[f"{key}/{strategy}/digest"] = _digest(params)
                out.update({f"{key}/{strategy}/{k}": v for k, v in facts.items()})
            for strategy, params in runs.items():
                out[f"{key}/{strategy}/vs_ddp"] = _compare(params, runs["ddp"])
            if comm.rank == 0:
                single, _ = _single(name, opt_name)
                for strategy, params in runs.items():
                    out[f"{key}/{strategy}/vs_single"] = _compare(params, single)
    out.update(_accumulation_and_clipping(comm))
    out.update(_zero2_details(comm))
    out.update(_mixed_precision(comm))
    out.update(_errors(comm))
    return out


def _accumulation_and_clipping(comm):
    """Two half-weighted micro-batches == one step on both; global-norm clipping == torch's."""
    out = {}
    model0 = build_model("tiny-gpt", seed=0, **GPT)
    first, second = global_batches(model0, 2, BATCH)
    both = tuple(torch.cat([a, b]) for a, b in zip(first, second))
    ref = _single("tiny-gpt", "sgd", [both])[0] if comm.rank == 0 else None
    for mode in ("z1", "z2", "z2-no_sync"):
        model = build_model("tiny-gpt", seed=0, **GPT)
        fwd, step, _, _, obj = build(comm, mode[:2], model, "sgd", 0.02)
        comm.stats.reset()
        for i, mb in enumerate((first, second)):
            if mode == "z2-no_sync" and i == 0:
                with obj.no_sync():
                    (fwd(*shard(mb, comm.rank, comm.size))[1] / 2).backward()
                out[f"accum/{mode}/full_grads_inside_no_sync"] = sum(p.grad is not None for p in model.parameters())
            else:
                (fwd(*shard(mb, comm.rank, comm.size))[1] / 2).backward()
        step()
        out[f"accum/{mode}/sent"] = comm.stats.sent()
        if comm.rank == 0:
            out[f"accum/{mode}"] = _compare(flat_params(model), ref)

    clip, batches = 0.05, global_batches(model0, 3, BATCH)
    if comm.rank == 0:
        ref, out["clip/ref_norms"] = _single("tiny-gpt", "sgd", batches, clip=clip)
    for mode in ("z1", "z2"):
        model = build_model("tiny-gpt", seed=0, **GPT)
        fwd, step, zero_grad, _, obj = build(comm, mode, model, "sgd", 0.02)
        norms = []
        for batch in batches:
            fwd(*shard(batch, comm.rank, comm.size))[1].backward()
            norms.append(obj.clip_grad_norm_(clip).item())
            step()
            zero_grad()
        out[f"clip/{mode}/norms"] = norms
        if comm.rank == 0:
            out[f"clip/{mode}"] = _compare(flat_params(model), ref)
    return out


def _zero2_details(comm):
    """Tied weight: one gradient per backward; unused parameter: grad stays None, no hang."""
    out = {}
    model = build_model("edge", seed=0)
    z2 = ShardGradOp(model, torch.optim.SGD, comm, bucket_numel=50, lr=0.1)
    fired = []
    model.emb.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    x, y = shard(global_batches(model, 1, BATCH)[0], comm.rank, comm.size)
    loss = z2(x, y)[1]
    if comm.rank == 0:
        loss = loss + model.unused.sum()  # d/d(unused) = 1 on rank 0 only
    loss.backward()
    out["tied_hook_calls"] = len(fired)
    out["edge_grads_left"] = [n for n, p in model.named_parameters()
                              if p.grad is not None and not is_placeholder(p.grad)]
    # the unused parameter's averaged gradient (1 + 0*(N-1))/N, read from the owner's shard
    L, r = z2.layout, comm.rank
    i = next(k for k, p in enumerate(z2.params) if p is model.unused)
    lo, hi = L.offsets[i], L.offsets[i + 1]
    a, b = max(lo, r * L.shard_numel), min(hi, (r + 1) * L.shard_numel)
    out["unused_grad_in_shard"] = z2.grad_shard[a - r * L.shard_numel:b - r * L.shard_numel].tolist() if a < b else []
    return out


def _mixed_precision(comm):
    """bf16 parameters: fp32 master shard, bf16 reductions; trains and the ledger adds up."""
    out = {}
    for mode in ("z1", "z2"):
        model = build_model("tiny-gpt", seed=0, **GPT).to(torch.bfloat16)
        fwd, step, zero_grad, measured, obj = build(comm, mode, model, "adam", 10_000)  # 20 KB of bf16
        losses = []
        for batch in global_batches(model, 4, BATCH):
            loss = fwd(*shard(batch, comm.rank, comm.size))[1]
            loss.backward()
            step()
            losses.append(loss.item())
            ledger = memory.measure(*measured).by_category
            zero_grad()
        out[f"bf16/{mode}/losses"] = losses
        out[f"bf16/{mode}/ledger"] = ledger
        out[f"bf16/{mode}/master_dtype"] = str((obj.optim if mode == "z2" else obj).master.dtype)
    return out


def _errors(comm):
    def msg(fn):
        try:
            fn()
            return "no error"
        except (RuntimeError, ValueError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
    model = build_model("edge", seed=0)
    z1 = ShardedOptimizer(model.parameters(), torch.optim.SGD, comm, lr=0.1)
    z2 = ShardGradOp(build_model("edge", seed=0), torch.optim.SGD, comm, lr=0.1)
    return {"err/z1_step_first": msg(z1.step), "err/z2_step_first": msg(z2.step),
            "err/z2_clip_first": msg(lambda: z2.clip_grad_norm_(1.0)),
            "err/empty": msg(lambda: ShardedOptimizer([], torch.optim.SGD, comm, lr=0.1)),
            "err/all_frozen": msg(lambda: ShardedOptimizer([model.frozen.weight], torch.optim.SGD, comm, lr=0.1)),
            "err/lbfgs": msg(lambda: ShardedOptimizer(model.parameters(), torch.optim.LBFGS, comm)),
            "err/instance": msg(lambda: ShardedOptimizer(model.parameters(), torch.optim.SGD(model.parameters(), lr=1),
                                                         comm)),
            "err/mixed_dtypes": msg(lambda: ShardedOptimizer([torch.nn.Parameter(torch.ones(2)),
                                                               torch.nn.Parameter(torch.ones(2, dtype=torch.float64))],
                                                              torch.optim.SGD, comm, lr=0.1))}
