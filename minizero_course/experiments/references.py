"""The ground truth every parallel strategy is checked against, in one place.

1. One process on the full global batch (`train_single`). Why it is the right reference: with a
   loss that is a mean over the batch, and N equal shards (data.shard enforces equal),

       grad of mean over B  =  (1/N) * sum over ranks of (grad of mean over the B/N rows of that rank)

   so DDP, which all-reduces gradients and divides by N, computes the same gradient as this
   loop, and so do ZeRO-1/2/3, which only change *where* the gradient and optimizer state live.
   The only difference is the order of floating-point additions (a sum over ranks instead of
   one sum over the batch), which is why the tests allow rtol ~1e-6 against this baseline, and
   ask for bitwise equality only between strategies that reduce in the same order.

2. The industrial reference: torch.nn.parallel.DistributedDataParallel (`train_torch_ddp`), run
   under our launcher on the same data with the same optimizer, so a test can say "minizero.DDP
   matches torch's DDP" and mean it.

Plus the two things every comparison must share so that runs differ only in the parallelism:
the global batches of a model, and the optimizer.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from minizero.data import SyntheticTokens, regression_batch, shard
from minizero.models import MLP, build_model


def _default_loss(model, batch):
    # Every minizero model returns (output, loss) when given its targets.
    return model(*batch)[1]


def train_single(model, optimizer, batches, loss_fn=None) -> list[float]:
    """Train `model` one step per global batch; return each step's loss as a float.

    batches: an iterable of global batches, each a tuple of model inputs, e.g.
             (data.batch(s, B) for s in range(steps)).
    loss_fn: loss_fn(model, batch) -> scalar loss tensor; defaults to model(*batch)[1].
    """
    loss_fn = loss_fn or _default_loss
    # Start from clean gradients: a stale .grad from an earlier call would be
    # added into the first step and make the reference wrong.
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        # set_to_none: the next backward writes fresh gradients instead of adding
        # into zeros, and a parameter that got no gradient keeps grad None, so
        # optimizers skip it exactly as they do in the sharded strategies.
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def global_batches(model: nn.Module, steps: int, batch_size: int, seed: int = 0) -> list:
    """The global (x, y) of each step for `model`: Markov tokens for the token models,
    tanh regression for the MLP. Pure functions of (seed, step), the same in every process."""
    if isinstance(model, MLP):
        return [regression_batch(s, batch_size, model.sizes[0], model.sizes[-1], seed=seed)
                for s in range(steps)]
    vocab = getattr(model, "vocab_size", None) or model.config.vocab_size
    block = getattr(model, "block_size", None) or model.config.block_size
    data = SyntheticTokens(vocab, block, seed=seed)
    return [data.batch(s, batch_size) for s in range(steps)]


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """"sgd" (with momentum, so state exists and must stay in sync) or "adam"."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; use 'sgd' or 'adam'")


def buffer_bytes(model: nn.Module) -> int:
    """Bytes of the model's buffers: what a data-parallel wrapper broadcasts from rank 0 before each
    training forward (torch DDP's broadcast_buffers=True), (N-1)/N of it sent per rank."""
    return sum(b.numel() * b.element_size() for b in model.buffers())


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter (tied ones once, frozen ones too), detached, in one fp32 vector."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def train_torch_ddp(comm, model_name: str = "tiny-gpt", steps: int = 5, global_batch: int = 12,
                    lr: float = 0.1, seed: int = 0, optimizer: str = "sgd",
                    model_kwargs: dict | None = None, data_seed: int = 0, process_group=None) -> dict:
    """Train with torch's DistributedDataParallel (gloo on CPU) on comm's ranks.

    Returns {"losses": global mean loss per step, "params": final flat_params as a list}.
    Needs `comm` to be the world communicator (torch DDP uses the default process group), or
    `process_group` to be the torch group of comm's ranks (made with dist.new_group by every rank).
    """
    import torch.distributed as dist

    from minizero.comm import init_torch_distributed
    if comm.backend != "torch":  # the mpi backend leaves torch.distributed alone: start it
        init_torch_distributed(torch.device("cpu"))
    if dist.get_world_size(process_group) != comm.size:
        raise RuntimeError("train_torch_ddp needs the world communicator, or the torch group of comm's ranks as "
                           f"process_group (torch DDP would run on {dist.get_world_size(process_group)} ranks, comm "
                           f"has {comm.size})")
    model = build_model(model_name, seed=seed, **(model_kwargs or {}))
    batches = global_batches(model, steps, global_batch, seed=data_seed)
    # torch DDP must be told about parameters that get no gradient, or its reducer waits
    # for them forever (it errors at the next step). Find out with one local trial
    # backward instead of hard-coding which models have one.
    trial = copy.deepcopy(model)
    trial(*batches[0])[1].backward()
    find_unused = any(p.grad is None for p in trial.parameters() if p.requires_grad)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused, process_group=process_group)
    opt = make_optimizer(optimizer, ddp.parameters(), lr)
    losses = []
    for batch in batches:
        x, y = shard(batch, comm.rank, comm.size)
        loss = ddp(x, y)[1]
        loss.backward()  # torch DDP reduces during backward and finishes by itself
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    # Local losses are per-shard means; their average over ranks is the global mean.
    losses = torch.stack(losses)
    dist.all_reduce(losses, group=process_group)
    return {"losses": (losses / comm.size).tolist(), "params": flat_params(model).tolist()}
