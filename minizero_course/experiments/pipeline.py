"""Pipeline experiments: what lesson 09, lab 09, the tests and the bench launch.

    TimedBlock, timed_model     an emulated device: stages that wait instead of computing
    train(comm, ...)            a few SGD steps of one pipeline configuration, with everything measured
    correctness(comm, configs)  parameters after training vs one process (and torch DDP, ZeRO-1)
    lesson(comm)                everything lesson 09 plots, in one 4-rank job
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from minizero.models import TinyGPT, token_loss
from minizero.pipeline import PipelineModel


# ----------------------------------------------------------------------------- an emulated device
class _Waits(torch.autograd.Function):
    """Identity that waits `forward_s` in forward and `backward_s` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class TimedBlock(nn.Module):
    """y = x + bias, where the forward, the input gradient (B) and the weight gradient (W) each
    take a set time without using the CPU: a GPU kernel the host waits for, as far as the pipeline
    can tell. On 2 cores, 4 ranks computing for real slow each other down; 4 ranks waiting do not,
    so the measured bubble shows the schedule and the runtime, not the CPU contention."""

    def __init__(self, n_embd: int, forward_s: float, backward_s: float, weight_s: float):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(n_embd))
        self.forward_s, self.backward_s, self.weight_s = forward_s, backward_s, weight_s

    def forward(self, x):
        return _Waits.apply(x, self.forward_s, self.backward_s) + _Waits.apply(self.bias, 0.0, self.weight_s)


def timed_model(num_blocks: int, blocks_per_stage: int, stage_ms=(4.0, 4.0, 4.0), n_embd=16, vocab_size=64,
                block_size=8):
    """A PipelineModel of TimedBlocks: a whole stage's F, B and W take stage_ms milliseconds."""
    f, b, w = (t / 1e3 / blocks_per_stage for t in stage_ms)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        embed, head = nn.Embedding(vocab_size, n_embd), nn.Linear(n_embd, vocab_size)
    return PipelineModel(embed, [TimedBlock(n_embd, f, b, w) for _ in range(num_blocks)], head, token_loss,
                         (block_size, n_embd))


# ----------------------------------------------------------------------------- one configuration
GPT = dict(vocab_size=64, block_size=8, n_head=2, n_embd=16, tie_weights=True)  # tests and lab: tiny and fast


def train(comm, schedule="1f1b", p=2, m=4, v=1, steps=5, micro=2, lr=0.1, gpt=None, blocks_per_chunk=1,
          timed_ms=None, dp_mode="ddp", rank_actions=None, reference=True, seed=0, data_seed=1, verbose=False,
          return_params=False):
    """Train TinyGPT (or, with timed_ms=(F, B, W), the emulated stages) with `schedule` on a
    dp x p mesh of comm's ranks, SGD with momentum, and measure every step.

    dp_mode: "ddp" (minizero DDP over mesh.dp, reduced once per step) or "zero1" (ShardedOptimizer
    over mesh.dp); ZeRO-2/3 under a pipeline are experiments.pp_zero's.
    rank_actions: a per-rank schedule generator replacing `schedule`'s (the lab's one_f_one_b).
    Returns this rank's measurements; with reference=True also how far its parameters are from
    one process trained on the whole batch (the atol needed at rtol 1e-6, and where)."""
    from minizero import memory
    from minizero.data import shard
    from minizero.models import GPTConfig
    from minizero.pipeline import PipelineRuntime, PipelineStage, make_schedule
    from minizero_course.experiments.references import global_batches, make_optimizer
    mesh = _mesh(comm, p)
    cfg = GPTConfig(**{**GPT, **(gpt or {}), "n_layer": p * v * blocks_per_chunk})
    full = TinyGPT(cfg, seed=seed)
    names = {id(q): n for n, q in full.named_parameters()}
    batches = global_batches(full, steps, micro * m * mesh.dp_size, seed=data_seed)
    parts = full.pipeline_parts() if timed_ms is None else \
        timed_model(cfg.n_layer, v * blocks_per_chunk, timed_ms, cfg.n_embd, cfg.vocab_size, cfg.block_size)
    stage = PipelineStage(parts, mesh, (micro, cfg.block_size, cfg.n_embd), num_chunks=v)
    plan = make_schedule(schedule, p, m, v, rank_actions=rank_actions)
    data_parallel, params = None, list(stage.parameters())
    if dp_mode == "zero1":
        from minizero.zero import ShardedOptimizer
        opt = ShardedOptimizer(params, torch.optim.SGD, mesh.dp, lr=lr, momentum=0.9)
    else:
        from minizero.dp import DDP
        data_parallel = DDP(stage, mesh.dp, mode="bucketed") if mesh.dp_size > 1 else None
        opt = make_optimizer("sgd", params, lr)
    pipe = PipelineRuntime(stage, plan, data_parallel=data_parallel, verbose=verbose)
    out = {"rank": comm.rank, "pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank, "losses": [], "events": [],
           "sent": [], "sent_by_op": [], "peak_in_flight": [], "peak_activation_bytes": [], "transient_peak": [],
           "p2p_theory": stage.p2p_bytes_per_step(m), "activation_nbytes": stage.activation_nbytes,
           "activation_shape": list(stage.activation_shape), "tied_numel": sum(q.numel() for q in stage.tied),
           "numel": sum(q.numel() for q in params),
           "padded_numel": getattr(getattr(opt, "layout", None), "padded_numel", None),
           "activation_bytes": None, "config": dict(schedule=schedule, p=p, m=m, v=v, dp=mesh.dp_size)}
    for x, y in batches:
        x, y = shard((x, y), mesh.dp_rank, mesh.dp_size)
        comm.barrier()
        comm.stats.reset()
        memory.transient.reset()
        loss = pipe.step(x, y)
        out["transient_peak"].append(memory.transient.peak)  # the ledger's high-water mark of the step
        opt.step()
        opt.zero_grad()
        out["sent"].append(comm.stats.sent())
        out["sent_by_op"].append({op: s["sent_bytes"] for op, s in comm.stats.as_dict().items() if op != "barrier"})
        out["losses"].append(None if loss is None else loss.item())
        for key in ("events", "peak_in_flight", "peak_activation_bytes"):
            out[key].append(pipe.last[key])
        out["activation_bytes"] = pipe.last["activation_bytes"]
    if return_params:
        out["params"] = {names[id(q)]: q.detach().reshape(-1).tolist() for q in stage.parameters()}
    if reference and timed_ms is None:
        out["reference"] = _distance_to_one_process(cfg, seed, batches, lr, stage, names)
    return out


_MESHES = {}


def _mesh(comm, p):
    """One Mesh per (communicator, p) for the life of the job: each costs five collective splits."""
    from minizero.comm import Mesh
    key = (id(comm), p)
    if key not in _MESHES:
        _MESHES[key] = Mesh(comm, pp=p)
    return _MESHES[key]


def _distance_to_one_process(cfg, seed, batches, lr, stage, names):
    from minizero_course.experiments.references import make_optimizer
    model = TinyGPT(cfg, seed=seed)
    opt = make_optimizer("sgd", model.parameters(), lr)
    losses = []
    for x, y in batches:
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    ref = dict(model.named_parameters())
    worst = {"atol_needed": -1.0, "losses": losses}
    for q in stage.parameters():
        r = ref[names[id(q)]].detach()
        diff = (q.detach() - r).abs()
        need = (diff - 1e-6 * r.abs()).max().item()
        if not need <= worst["atol_needed"]:
            worst = {"atol_needed": need, "max_diff": diff.max().item(), "param": names[id(q)], "losses": losses}
    return worst


def correctness(comm, configs, **kwargs):
    """train() for each (schedule, p, m, v, dp_mode) in `configs`: one launch, many configurations."""
    return [train(comm, schedule, p, m, v, dp_mode=dp_mode, **kwargs) for schedule, p, m, v, dp_mode in configs]


# ----------------------------------------------------------------------------- lesson 09
def lesson(comm, m=8, timed_ms=(4.0, 4.0, 4.0), sweep=(1, 4, 16)):
    """Everything lesson 09 shows, in ONE job, p = comm.size stages (4 in the lesson):
      timelines   every schedule on the emulated device, and 1F1B on real TinyGPT (CPU contention)
      sweep       the measured bubble for several m (emulated device)
      memory      every schedule on TinyGPT: activations held per stage, bytes sent (1 step)
      growth      GPipe vs 1F1B activations as m grows
      exact       1F1B, 5 steps: distance to one process and both loss curves
      pp_zero     dp 2 x pp 2: ZeRO-1, ZeRO-2 (reduced once or every micro-batch), ZeRO-3 as the data-parallel
                  half: step time, ledger, bytes, distance (experiments.pp_zero.measure)"""
    import os
    p = comm.size
    v_of = {"interleaved_1f1b": 2}
    out = {"load_average": [os.getloadavg()], "timelines": {}, "sweep": {}, "memory": {}, "growth": {}}
    keep = ("config", "rank", "pp_rank", "dp_rank", "events", "peak_in_flight", "transient_peak", "activation_bytes",
            "sent_by_op", "p2p_theory", "activation_nbytes", "activation_shape", "tied_numel", "losses", "reference",
            "numel")

    def run(*args, **kwargs):
        return {k: v for k, v in train(comm, *args, **kwargs).items() if k in keep}
    for s in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"):
        out["timelines"][s] = run(s, p, m, v_of.get(s, 1), steps=3, timed_ms=timed_ms, reference=False)["events"]
    out["timelines"]["1f1b on TinyGPT"] = run("1f1b", p, m, steps=3, gpt={"n_embd": 64, "block_size": 32},
                                               blocks_per_chunk=2, reference=False)["events"]
    for s in ("1f1b", "interleaved_1f1b", "zb_h1"):
        out["sweep"][s] = {str(k): run(s, p, k, v_of.get(s, 1), steps=2, timed_ms=timed_ms, reference=False)["events"]
                           for k in sweep}
    out["load_average"].append(os.getloadavg())
    for s in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"):
        out["memory"][s] = run(s, p, m, v_of.get(s, 1), steps=1, reference=False)
    for s in ("gpipe", "1f1b"):
        out["growth"][s] = {str(k): run(s, p, k, steps=1, reference=False)["peak_in_flight"][0] for k in (2, 16)}
    out["exact"] = run("1f1b", p, m, steps=5)
    from minizero_course.experiments.pp_zero import measure
    out["pp_zero"] = measure(comm, steps=3, lost=("zero2-every",), mesh=_mesh(comm, 2))  # dp 2 x pp 2 on 4 ranks
    out["load_average"].append(os.getloadavg())
    return out
