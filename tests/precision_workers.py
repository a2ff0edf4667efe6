"""Functions the precision tests run on several ranks through minizero.launch (never in pytest itself)."""
import torch

from minizero import precision
from minizero_course.experiments import mixed_precision
from minizero.data import SyntheticTokens
from minizero.models import TinyGPT


def _replica_run(comm, vote_comm, steps, bad_step, bad_rank):
    """Every rank trains the same model on the same batch (replicas, no gradient averaging), so the
    overflow vote over `vote_comm` is the only thing coupling them. bad_rank gets an inf at bad_step."""
    model = TinyGPT(seed=0).to(torch.float16)
    scaler = precision.LossScaler(initial_scale_power=10, hysteresis=1)
    opt = precision.MixedPrecisionOptimizer(model.parameters(), torch.optim.Adam, scaler, comm=vote_comm, lr=3e-3)
    data, skipped, scales = SyntheticTokens(seed=0), [], []
    comm.stats.reset()
    for step in range(steps):
        x, y = data.batch(step, 4)
        opt.backward(precision.fp32_loss(model, x, y))
        if step == bad_step and comm.rank == bad_rank:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        opt.step()
        opt.zero_grad()
        skipped.append(opt.overflow)
        scales.append(scaler.loss_scale)
    ar = comm.stats.ops.get("all_reduce")
    return {"skipped": skipped, "scales": scales,
            "params": [float(p.double().sum()) for p in model.parameters()],
            "sent": comm.stats.sent(), "all_reduce_calls": ar.calls if ar else 0}


def overflow_vote(comm, steps=5, bad_step=2):
    """The same injected overflow twice: ranks voting over the world, and ranks each alone."""
    bad_rank = comm.size - 1
    world = _replica_run(comm, comm, steps, bad_step, bad_rank)
    alone = comm.split(color=comm.rank)  # a communicator of one: no vote
    solo = _replica_run(comm, alone, steps, bad_step, bad_rank)
    comm.stats.reset()
    dp = mixed_precision.train(comm, "fp16", steps=steps, fp16={"initial_scale_power": 10, "hysteresis": 1},
                         inject=[[bad_rank, bad_step]])
    # global-norm clipping across shards: each rank holds a different piece of one gradient vector
    full = torch.randn(1001, generator=torch.Generator().manual_seed(5))
    mine = [full.tensor_split(comm.size)[comm.rank].clone()]
    norm = precision.clip_grad_norm_(mine, 0.5, shard_comm=comm)
    clip = {"norm": float(norm), "full_norm": float(full.norm()), "shard_sq_after": float(mine[0].pow(2).sum())}
    return {"world": world, "alone": solo, "bad_rank": bad_rank, "dp": dp, "clip": clip}
