"""What the DDP tests run on N ranks through minizero.launch (never inside pytest itself).

One job per N does everything, because each launch costs seconds: every mode x model x
optimizer, the single-process and torch-DDP references, and the API checks."""
import hashlib
import warnings

import torch

from minizero import memory
from minizero_course.experiments.references import train_single
from minizero.data import shard
from minizero.dp.ddp import DDP
from minizero.models import build_model
from minizero_course.experiments.references import flat_params, global_batches, make_optimizer, train_torch_ddp

torch.set_num_threads(1)

# Small enough for 4 ranks on 2 cores, tied so that "count a tied weight once" is tested
# on the transformer too (the edge model ties, freezes and leaves a parameter unused).
GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
MODELS = {"tiny-gpt": GPT, "edge": {}}
LR = {"sgd": 0.1, "adam": 1e-2}
STEPS, BATCH = 5, 12  # 12 divides over 1, 2, 3 and 4 ranks
# A small bucket splits each model into several buckets (the GPT's 112 KB of gradients
# into 7, the edge model's 836 B into 5), so overlap really launches early buckets during
# backward, and the edge model's unused parameter sits in a middle one. 6.25M fp32 gradients (25 MB, the
# default) makes one bucket.
SMALL_BUCKET_NUMEL = {"tiny-gpt": 5000, "edge": 50}  # fp32 gradients per bucket
MODES = {"naive": ("naive", None), "bucketed": ("bucketed", "small"),
         "overlap": ("overlap", "small"), "overlap-1bucket": ("overlap", 6_250_000)}


def _digest(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def _compare(a, b):
    """max |a - b|, and the smallest atol for which allclose(a, b, rtol=1e-6, atol) holds."""
    d = (a - b).abs()
    return {"max_abs": d.max().item(), "atol_needed": (d - 1e-6 * b.abs()).clamp_min(0).max().item()}


def _train_ddp(comm, name, opt_name, mode, bucket_numel):
    model = build_model(name, seed=0, **MODELS[name])
    bucket_numel = SMALL_BUCKET_NUMEL[name] if bucket_numel == "small" else bucket_numel
    ddp = DDP(model, comm, mode=mode, bucket_numel=bucket_numel)
    opt = make_optimizer(opt_name, model.parameters(), LR[opt_name])
    sent, unused_none, launched = [], True, []
    for batch in global_batches(model, STEPS, BATCH):
        comm.stats.reset()  # so the broadcast at construction is not counted
        loss = ddp(*shard(batch, comm.rank, comm.size))[1]
        loss.backward()
        launched.append(sum(bool(b.works) for b in ddp.buckets))  # during backward
        ddp.finish_gradient_synchronization()
        sent.append(comm.stats.sent())
        grad_bytes = memory.measure(ddp).by_category["gradients"]
        if name == "edge":
            unused_none &= model.unused.grad is None and model.frozen.weight.grad is None
        opt.step()
        opt.zero_grad(set_to_none=True)
    return flat_params(model), dict(
        sent=sent, unused_grad_none=unused_none, buckets=len(ddp.buckets), launched_in_backward=launched,
        grad_bytes=grad_bytes, grad_bytes_between_steps=memory.measure(ddp).by_category["gradients"])


def train_all(comm):
    """Every mode on both models with SGD and Adam, against single-process and torch DDP."""
    out = {"warnings": []}
    for name in MODELS:
        psi = sum(p.numel() for p in build_model(name, seed=0, **MODELS[name]).parameters()
                  if p.requires_grad)
        out[f"{name}/psi"] = psi
        for opt_name in LR:
            key = f"{name}/{opt_name}"
            runs = {}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for label, (mode, mb) in MODES.items():
                    params, facts = _train_ddp(comm, name, opt_name, mode, mb)
                    runs[label] = params
                    out[f"{key}/{label}/digest"] = _digest(params)
                    out.update({f"{key}/{label}/{k}": v for k, v in facts.items()})
            out["warnings"] += [str(w.message) for w in caught]
            ref = torch.tensor(train_torch_ddp(comm, name, STEPS, BATCH, LR[opt_name], seed=0,
                                               optimizer=opt_name, model_kwargs=MODELS[name])["params"])
            out[f"{key}/torch/digest"] = _digest(ref)
            for label, params in runs.items():
                out[f"{key}/{label}/vs_torch"] = _compare(params, ref)
            if comm.rank == 0:  # the ground truth: one process, the whole batch
                model = build_model(name, seed=0, **MODELS[name])
                opt = make_optimizer(opt_name, model.parameters(), LR[opt_name])
                train_single(model, opt, global_batches(model, STEPS, BATCH))
                single = flat_params(model)
                for label, params in runs.items():
                    out[f"{key}/{label}/vs_single"] = _compare(params, single)
                out[f"{key}/torch/vs_single"] = _compare(ref, single)
    out.update(_api_checks(comm))
    return out


def _api_checks(comm):
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # 1. Ranks that built different weights (and buffers) end up with rank 0's.
        model = build_model("edge", seed=comm.rank)
        model.scale.add_(comm.rank)
        DDP(model, comm)
        want = build_model("edge", seed=0).state_dict()
        out["broadcast_ok"] = all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
        out["state_dict_keys_ok"] = list(DDP(model, comm).state_dict()) == list(want)

        # 2. no_sync: two micro-batches (each loss halved) == one step on both together.
        for mode, numel in (("naive", None), ("bucketed", 5000), ("overlap", 5000)):
            model = build_model("tiny-gpt", seed=0, **GPT)
            ddp = DDP(model, comm, mode=mode, bucket_numel=numel)
            first, second = global_batches(model, 2, BATCH)
            comm.stats.reset()
            with ddp.no_sync():
                (ddp(*shard(first, comm.rank, comm.size))[1] / 2).backward()
            out[f"no_sync/{mode}/sent_inside"] = comm.stats.sent()
            (ddp(*shard(second, comm.rank, comm.size))[1] / 2).backward()
            ddp.finish_gradient_synchronization()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            if comm.rank == 0:
                ref = build_model("tiny-gpt", seed=0, **GPT)
                both = tuple(torch.cat([a, b]) for a, b in zip(first, second))
                train_single(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [both])
                out[f"no_sync/{mode}"] = _compare(flat_params(model), flat_params(ref))

        # 3. Re-wrapping a model: the dropped wrapper's hooks must not reduce anything.
        model = build_model("tiny-gpt", seed=0, **GPT)
        DDP(model, comm, mode="overlap", bucket_numel=5000)  # dropped at once
        ddp = DDP(model, comm, mode="overlap", bucket_numel=5000)
        comm.stats.reset()
        ddp(*shard(global_batches(model, 1, BATCH)[0], comm.rank, comm.size))[1].backward()
        ddp.finish_gradient_synchronization()
        out["rewrap_sent"] = comm.stats.sent()

        # 4. A parameter only rank 0 uses: every rank gets the average (1/N), none hangs.
        for mode, numel in (("naive", None), ("bucketed", 50), ("overlap", 50)):
            ddp = DDP(build_model("edge", seed=0), comm, mode=mode, bucket_numel=numel)
            x, y = shard(global_batches(ddp.module, 1, BATCH)[0], comm.rank, comm.size)
            loss = ddp(x, y)[1]
            if comm.rank == 0:
                loss = loss + ddp.module.unused.sum()  # d/d(unused) = 1 on rank 0 only
            loss.backward()
            ddp.finish_gradient_synchronization()
            g = ddp.module.unused.grad
            out[f"used_by_rank0/{mode}"] = None if g is None else g.unique().tolist()

        # 5. finish twice for one backward, and a backward that was never finished.
        ddp = DDP(build_model("edge", seed=0), comm, mode="overlap", bucket_numel=25)
        batch = shard(global_batches(ddp.module, 1, BATCH)[0], comm.rank, comm.size)
        ddp(*batch)[1].backward()
        ddp.finish_gradient_synchronization()
        try:
            ddp.finish_gradient_synchronization()
            out["finish_twice"] = "no error"
        except RuntimeError as e:
            out["finish_twice"] = str(e)
        ddp(*batch)[1].backward()
        try:
            ddp(*batch)[1].backward()
            out["backward_twice"] = "no error"
        except RuntimeError as e:
            out["backward_twice"] = str(e)
    out["api_warnings"] = [str(w.message) for w in caught]
    return out


def torch_backend_smoke(comm):
    """The same wrapper over the torch.distributed (gloo) backend: async handles differ."""
    model = build_model("edge", seed=0)
    opt = make_optimizer("sgd", model.parameters(), LR["sgd"])
    train_single(model, opt, global_batches(model, STEPS, BATCH))
    out = {"backend": comm.backend}
    for mode, numel in (("naive", None), ("overlap", SMALL_BUCKET_NUMEL["edge"])):
        params, facts = _train_ddp(comm, "edge", "sgd", mode, numel)
        out[mode] = _compare(params, flat_params(model))
        out[f"{mode}/sent"] = facts["sent"]
    return out
