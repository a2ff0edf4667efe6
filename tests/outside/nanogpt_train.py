"""nanoGPT's training loop, in this repo's words, under each wrapper a user would swap in by changing the
wrapper line(s). Run by tests/test_outside.py as `torchrun --nproc_per_node 2 tests/outside/nanogpt_train.py`;
every mode in one launch, so torch's own DDP (the ground truth) and minizero share the process group.

The idioms kept from nanoGPT's train.py: a different seed on every rank (1337 + rank) before the model is
built, the optimizer built on the RAW model before wrapping (configure_optimizers: decay / no-decay groups),
gradient accumulation with `model.require_backward_grad_sync = (last micro-step)`, the loss divided by the
accumulation steps, clipping, an LR schedule (here a LambdaLR with warm-up), zero_grad(set_to_none=True).
The lines each mode changes are marked `# <- mode` (the README's drop-in table lists them). A mode
"zeroK:torch_clip" keeps nanoGPT's own clip line, torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).
After training every mode runs nanoGPT's checkpoint lines (raw_model.state_dict(), optimizer.state_dict()):
each either returns what torch DDP's return or raises at the call, naming the call that gathers.
"""
import json
import sys
import warnings

import torch

import minizero
from minizero import comm
from minizero.dp.ddp import DDP
from minizero.zero import FSDP, ShardedOptimizer, ShardGradOp
from nanogpt_model import GPT, Config  # beside this script (torchrun puts its folder on sys.path)

ITERS, ACCUM, BATCH = 4, 2, 4          # optimizer steps, micro-steps per step, sequences per micro-batch
LR, CLIP, WEIGHT_DECAY, BETAS = 3e-3, 0.05, 0.1, (0.9, 0.95)   # CLIP small enough that it always clips


def lr_lambda(it):
    return min(1.0, (it + 1) / 2)  # warm-up over two steps


def get_batch(rank, it, micro, cfg):
    """This rank's micro-batch: the same for every mode (the data is not the wrappers' business)."""
    gen = torch.Generator().manual_seed(10_000 * it + 100 * micro + rank)
    data = torch.randint(cfg.vocab_size, (BATCH, cfg.block_size + 1), generator=gen)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def full_state(mode, model):
    if mode == "zero3" or mode.startswith("engine"):
        return model.full_state_dict() if mode.startswith("engine") else model.state_dict()  # collectives
    raw = model.module if hasattr(model, "module") else model
    return raw.state_dict()


def error_of(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def summary(state_dict):
    """A state dict as numbers the test compares: the model's shapes, an optimizer's per-parameter state."""
    if "state" not in state_dict:
        return {"shapes": {k: list(v.shape) for k, v in state_dict.items()}}
    state = {str(i): {k: v.reshape(-1).tolist() for k, v in st.items()} for i, st in state_dict["state"].items()}
    return {"numel": sum(v.numel() for st in state_dict["state"].values() for v in st.values() if v.dim()),
            "state": state, "lr": [g["lr"] for g in state_dict["param_groups"]]}


def checkpoint(model, optimizer, rank):
    """nanoGPT's checkpoint lines (rank 0 saves {'model': raw_model.state_dict(), 'optimizer': ...})."""
    raw_model = model.module if hasattr(model, "module") else model  # nanoGPT: model.module if ddp else model
    out = {"model_error": error_of(raw_model.state_dict), "optimizer_error": error_of(optimizer.state_dict)}
    if out["model_error"] is None:
        out["model"] = summary(raw_model.state_dict())
    if out["optimizer_error"] is not None and hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)  # the call the error names, on every rank
    if rank == 0 and error_of(optimizer.state_dict) is None:
        out["optimizer"] = summary(optimizer.state_dict())
    return out


def train(mode, world):
    mode, _, variant = mode.partition(":")
    rank = world.rank
    torch.manual_seed(1337 + rank)  # nanoGPT: every rank its own seed, model init included
    cfg = Config()
    model = GPT(cfg)
    optimizer = model.configure_optimizers(WEIGHT_DECAY, LR, BETAS)  # on the raw model, before wrapping
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # noqa: E731
    if mode == "torch_ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        train.initial = {k: v.clone() for k, v in model.module.state_dict().items()}  # rank 0's, broadcast
    elif mode == "ddp":
        model = DDP(model, world)                                                            # <- ddp
        clip = lambda: model.clip_grad_norm_(CLIP)  # noqa: E731                             # <- ddp
    elif mode == "zero1":
        optimizer = ShardedOptimizer(model.optim_groups(WEIGHT_DECAY), torch.optim.AdamW, world, module=model,
                                     lr=LR, betas=BETAS)                                     # <- zero1
        clip = lambda: optimizer.clip_grad_norm_(CLIP)  # noqa: E731                         # <- zero1
    elif mode == "zero2":
        model = ShardGradOp(model, torch.optim.AdamW, world, params=model.optim_groups(WEIGHT_DECAY),
                            lr=LR, betas=BETAS)                                              # <- zero2
        optimizer = model.optim                                                              # <- zero2
        clip = lambda: model.clip_grad_norm_(CLIP)  # noqa: E731                             # <- zero2
    elif mode == "zero3":
        model = FSDP(model, world)                                                           # <- zero3
        clip = lambda: model.clip_grad_norm_(CLIP)  # noqa: E731                             # <- zero3
    elif mode.startswith("engine"):                                                          # <- engine
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": ACCUM,
                  "gradient_clipping": CLIP, "zero_optimization": {"stage": int(mode[-1])},
                  "bf16": {"enabled": variant == "bf16"}}
        model, optimizer, _, _ = minizero.initialize(
            model=model, optimizer=optimizer,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
            config=config, comm=world)
        return deepspeed_loop(mode, model, world, cfg)
    if variant == "torch_clip":
        clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # noqa: E731  nanoGPT's own line
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    losses, norms = [], []
    for it in range(ITERS):
        total = 0.0
        for micro in range(ACCUM):
            model.require_backward_grad_sync = micro == ACCUM - 1
            x, y = get_batch(rank, it, micro, cfg)
            _, loss = model(x, y)
            (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        if mode == "ddp":
            model.finish_gradient_synchronization()                                          # <- ddp
        norms.append(float(clip()))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return {"losses": losses, "norms": norms, "checkpoint": checkpoint(model, optimizer, rank)}, \
        full_state(mode, model)


def deepspeed_loop(mode, engine, world, cfg):
    """DeepSpeed's loop: engine(x) / engine.backward / engine.step (clipping and the schedule are the engine's)."""
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for it in range(ITERS):
            total = 0.0
            for micro in range(ACCUM):
                x, y = get_batch(world.rank, it, micro, cfg)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                total += loss.item() / ACCUM
            losses.append(total)
    lr_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    return {"losses": losses, "warnings": lr_warnings}, full_state(mode, engine)


def main(modes):
    world = comm.init()  # torchrun's environment; torch's DDP below uses the same default process group
    out = {"clip": CLIP}
    for mode in modes:
        result, state = train(mode, world)
        out[mode] = {**result, "state": {k: v.detach().float().reshape(-1).tolist() for k, v in state.items()}}
    if hasattr(train, "initial"):
        out["initial"] = {"losses": [], "state": {k: v.reshape(-1).tolist() for k, v in train.initial.items()}}
    if world.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    comm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1].split(","))
