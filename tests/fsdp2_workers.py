"""What tests/test_fsdp2_layout.py runs on N ranks (torch backend: gloo, so torch's own fully_shard runs too).

One launch per N: the same TinyGPT, data and SGD under
  * the single process on the global batch (the ground truth),
  * minizero's FSDP with shard_layout="per_param", stepped by FSDPOptimizer (the engine's), and
  * torch's FSDP2 (fully_shard on each block, then the root), stepped by torch.optim.SGD,
  * the engine with zero_optimization.shard_layout "per_param", its checkpoint resumed by both layouts,
and, after the first backward, code written in FSDP2's style on both: each parameter's gradient
piece all-gathered with dist.all_gather_into_tensor, torch's clip_grad_norm_ on model.parameters().
Every number returned is measured: shapes from the tensors, bytes from comm.stats, memory from
memory.measure."""
import torch
import torch.distributed as dist

from minizero import memory
from minizero.data import shard
from minizero_course.experiments.references import global_batches
from minizero.models import build_model
from minizero.runtime.engine import build_engine
from minizero.zero.fsdp import FSDP
from minizero.zero.fsdp_optimizer import FSDPOptimizer

torch.set_num_threads(1)

GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
LR, MOMENTUM, STEPS, BATCH = 0.1, 0.9, 4, 12  # 12 divides over 2 and 3 ranks


def _gather_pieces(piece, dim0, world):
    """FSDP2-style: every rank's dim-0 piece of one parameter, padded to ceil(dim0 / N) rows (what
    DTensor.full_tensor does for an uneven Shard(0)), all-gathered with dist.all_gather_into_tensor."""
    rows = -(-dim0 // world)
    padded = piece.new_zeros((rows, *piece.shape[1:]))
    padded[:piece.shape[0]] = piece
    out = piece.new_empty((rows * world, *piece.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous())
    return out[:dim0], bool(piece.shape[0] == rows)


def _single(batches):
    model = build_model("tiny-gpt", seed=0, **GPT)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, first_grads, first_norm = [], None, None
    for x, y in batches:
        loss = model(x, y)[1]
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            first_norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in first_grads.values()])))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, first_grads, first_norm


def _torch_fsdp2(comm, batches):
    from torch.distributed.fsdp import fully_shard
    model = build_model("tiny-gpt", seed=0, **GPT)
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = {"losses": [], "shapes": {n: list(p.to_local().shape) for n, p in model.named_parameters()}}
    for step, b in enumerate(batches):
        loss = model(*shard(b, comm.rank, comm.size))[1]
        loss.backward()
        if step == 0:
            out["grad_shapes"] = {n: list(p.grad.to_local().shape) for n, p in model.named_parameters()}
            out["gathered"] = {n: _gather_pieces(p.grad.to_local(), p.shape[0], comm.size)[0]
                               for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        out["losses"].append(loss.item() / comm.size)
    out["params"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    return out


def _minizero(comm, batches, checks=True, **kw):
    model = FSDP(build_model("tiny-gpt", seed=0, **GPT), comm, shard_layout="per_param", **kw)
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    out = {"losses": [], "shapes": {n: list(p.shape) for n, p in model.named_parameters()},
           "units": [{"name": u.name, "shard_numel": u.layout.shard_numel} for u in model.units]}
    comm.stats.reset()
    with torch.no_grad():  # a forward alone: every unit all-gathered exactly once
        model(*shard(batches[0], comm.rank, comm.size))
    out["forward_sent"] = {op: s["sent_bytes"] for op, s in comm.stats.as_dict().items()}
    for step, b in enumerate(batches):
        loss = model(*shard(b, comm.rank, comm.size))[1]
        comm.stats.reset()
        loss.backward()
        if step == 0 and checks:
            out["backward_sent"] = {op: s["sent_bytes"] for op, s in comm.stats.as_dict().items()}
            out["ledger"] = memory.measure(model).by_category
            named = list(model.named_parameters())
            out["grad_shapes"] = {n: list(p.grad.shape) for n, p in named}
            gathered = {n: _gather_pieces(p.grad.to_local(), p.full_shape[0], comm.size) for n, p in named}
            out["gathered"] = {n: g for n, (g, _) in gathered.items()}
            out["equal_pieces"] = {n: equal for n, (_, equal) in gathered.items()}
            out["full_tensor"] = {n: p.grad.full_tensor() for n, p in named}
            out["torch_clip_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"),
                                                                          norm_type=2.0))
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        comm.all_reduce(loss, op="avg")
        out["losses"].append(loss.item())
    out["params"] = model.gather_full_params()
    return out


def _engine(comm, batches, ckpt, layout="per_param", load=False):
    """The DeepSpeed-style engine with the config key; SGD as above, no clipping. Saves after half the steps,
    or (load) starts from that checkpoint and runs the second half."""
    cfg = {"train_micro_batch_size_per_gpu": BATCH // comm.size, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
           "zero_optimization": {"stage": 3, "shard_layout": layout, "stage3_param_persistence_threshold": 0}}
    engine = build_engine(build_model("tiny-gpt", seed=0, **GPT), cfg, comm)
    half = len(batches) // 2
    if load:
        engine.load_checkpoint(ckpt)
    losses = []
    for step, b in enumerate(batches[half:] if load else batches):
        if step == half and not load:
            engine.save_checkpoint(ckpt)
        loss = engine(*shard(b, comm.rank, comm.size))
        engine.backward(loss)
        engine.step()
        loss = loss.detach().clone()
        comm.all_reduce(loss, op="avg")
        losses.append(loss.item())
    return {"losses": losses, "shapes": {n: list(p.shape) for n, p in engine.module.named_parameters()}}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def run_all(comm, ckpt):
    batches = global_batches(build_model("tiny-gpt", seed=0, **GPT), STEPS, BATCH)
    single, losses, grads, norm = _single(batches)
    params = {n: p.detach() for n, p in single.named_parameters()}
    mz, peer = _minizero(comm, batches), _torch_fsdp2(comm, batches)
    flat = FSDP(build_model("tiny-gpt", seed=0, **GPT), comm)  # the default layout, for contrast: one flat cut
    out = {"single_losses": losses, "single_norm": norm,
           "flat_shapes": {n: list(p.shape) for n, p in flat.named_parameters()}}
    for name, run in (("minizero", mz), ("torch", peer)):
        out[name] = {"losses": run["losses"], "shapes": run["shapes"], "grad_shapes": run["grad_shapes"],
                     "gathered_grad_diff": _max_diff(run["gathered"], grads),
                     "param_diff": _max_diff(run["params"], params)}
    # biases and norm weights (at most 128 elements) whole on every rank, the rest in per-parameter pieces
    out["persistent"] = {k: v for k, v in _minizero(comm, batches, False, persistence_threshold=129).items()
                         if k in ("losses", "shapes")}
    out["bf16"] = _minizero(comm, batches, False, compute_dtype=torch.bfloat16)["losses"]  # cast before the gather
    out["engine"] = _engine(comm, batches, ckpt)  # saves a checkpoint half way; then resumed from it:
    out["resumed"] = {layout: _engine(comm, batches, ckpt, layout, load=True)["losses"]
                      for layout in ("per_param", "flat")}
    out["minizero"].update({k: mz[k] for k in ("units", "forward_sent", "backward_sent", "ledger", "equal_pieces",
                                               "torch_clip_norm")},
                           full_tensor_diff=_max_diff(mz["full_tensor"], grads))
    return out
