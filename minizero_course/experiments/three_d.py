"""3D parallelism measured: who talks to whom, and what a step costs (lesson 11, `bench 3d`).

`run(comm, layouts)` builds one engine per layout on the same ranks (minizero.initialize: `pipeline.stages`
x `tensor_parallel.autotp_size` x the rest data parallel, or plain data parallelism), all training the same
TinyGPT on the same global batch, and steps them in turn (step k of every layout, then step k+1: a burst of
load hits each alike). The world is cut into simulated nodes of `node_size` consecutive ranks
(`comm.set_nodes`, as a Mesh does), so every byte is booked intra- or cross-node where it is sent. Per rank
and layout it returns:
  * coords: (d, p, t) on the engine's Mesh;
  * sent: bytes sent in the last step, by group (dp, pp, tp; "other": the tied embedding's all-reduce
    and the engine's one-element collectives) and by link (intra-node, cross-node), from comm.stats;
  * planned: the planner's bytes for this rank's stage by group and link (minizero/planner never sees
    a measurement);
  * step_s: each timed step's wall time, the slowest rank's (a step ends when every rank is done);
  * losses: every step's loss, the same on every rank of a layout.
"""
from __future__ import annotations

import time

import torch

from minizero.data import shard
from minizero_course.experiments.references import global_batches
from minizero.models import GPTConfig, TinyGPT
from minizero.planner import ModelShape, ParallelStrategy, plan
from minizero.runtime.engine import build_engine

# the lesson's default: 8 ranks as 2 nodes of 4; 3D = dp 2 x pp 2 x tp 2 against dp 8, both ZeRO-1
LAYOUTS = ({"name": "dp8-zero1", "pp": 1, "tp": 1, "zero": 1},
           {"name": "dp2-pp2-tp2-zero1", "pp": 2, "tp": 2, "zero": 1, "schedule": "1f1b"})


def _engine(model_cfg: dict, layout: dict, comm, global_batch: int, micro: int, lr: float):
    world = comm.size
    dp = world // (layout["pp"] * layout["tp"])
    per_dp = global_batch // dp                      # the rows one data-parallel replica sees per step
    config = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": per_dp // micro,
              "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}},
              "zero_optimization": {"stage": layout["zero"]}}
    if layout["pp"] > 1:
        config["pipeline"] = {"stages": layout["pp"], "schedule": layout.get("schedule", "1f1b")}
    if layout["tp"] > 1:
        config["tensor_parallel"] = {"autotp_size": layout["tp"]}
    return build_engine(TinyGPT(GPTConfig(**model_cfg)), config, comm=comm)


def _planned(model_cfg: dict, layout: dict, comm, node_size: int, global_batch: int, micro: int, stage: int):
    g = GPTConfig(**model_cfg)
    shape = ModelShape(g.n_layer, g.n_embd, g.n_head, g.block_size, g.vocab_size, g.tie_weights)
    dp = comm.size // (layout["pp"] * layout["tp"])
    strategy = ParallelStrategy(comm.size, node_size=node_size, tp=layout["tp"], pp=layout["pp"], zero=layout["zero"],
                        micro_batch=micro, micro_batches=global_batch // dp // micro,
                        schedule=layout.get("schedule", "1f1b"), precision="fp32", optimizer="sgd")
    st = plan(shape, strategy).stages[stage]
    return {"by_group": dict(st.sent), "by_link": st.sent_by_link, "link": dict(st.link)}


def _groups(engine) -> dict:
    """The communicators whose bytes count per group: the Mesh's axes, or the world for plain DP."""
    mesh = getattr(engine, "mesh", None)
    if mesh is None:
        return {"dp": engine.comm}
    return {"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp}


def _calls(comm) -> int:
    """Collectives and p2p messages this rank has issued (each one a rendezvous with its peers)."""
    return sum(op.calls for op in comm.stats.ops.values())


def _one_step(engine, comm, x, y, micro):
    """One optimizer step on this rank's rows; returns the loss (the same on every rank)."""
    rows = (shard((x, y), engine.dp_rank, engine.dp_size) if hasattr(engine, "dp_rank")
            else shard((x, y), comm.rank, comm.size))
    pieces = list(zip(rows[0].split(micro), rows[1].split(micro)))
    if hasattr(engine, "train_batch"):
        return engine.train_batch(iter(pieces)).item()
    total = 0.0
    for xm, ym in pieces:
        loss = engine(xm, ym)
        engine.backward(loss)
        engine.step()
        total += loss.item() / len(pieces)
    out = torch.tensor([total])
    comm.all_reduce(out, op="avg")
    return out.item()


def run(comm, layouts=LAYOUTS, model_cfg=None, node_size=4, global_batch=16, micro=2, steps=5, warmup=1,
        lr=0.05, seed=3):
    """Runs on every rank; see the module docstring. model_cfg: GPTConfig fields (a small TinyGPT by default)."""
    torch.set_num_threads(1)
    model_cfg = model_cfg or dict(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)
    engines = [_engine(model_cfg, layout, comm, global_batch, micro, lr) for layout in layouts]
    comm.set_nodes([r // node_size for r in range(comm.size)])  # after the engines' Meshes: nodes of node_size
    batches = global_batches(TinyGPT(GPTConfig(**model_cfg)), warmup + steps, global_batch, seed=seed)
    out = [{"layout": layout, "losses": [], "step_s": []} for layout in layouts]
    for k, (x, y) in enumerate(batches):
        for i in (range(len(engines)) if k % 2 == 0 else reversed(range(len(engines)))):
            engine, res = engines[i], out[i]
            groups = _groups(engine)
            before = {g: c.stats.sent() for g, c in groups.items()}
            total, cross, calls = comm.stats.sent(), comm.stats.cross_node(), _calls(comm)
            comm.barrier()  # the ranks start together (the last step ended with an all-reduce)
            t0 = time.perf_counter()
            loss = _one_step(engine, comm, x, y, micro)
            elapsed = torch.tensor([time.perf_counter() - t0])
            by_group = {g: c.stats.sent() - before[g] for g, c in groups.items()}
            sent = comm.stats.sent() - total
            by_group["other"] = sent - sum(by_group.values())
            res["sent"] = {"by_group": by_group, "by_link": {"intra-node": sent - (comm.stats.cross_node() - cross),
                                                             "cross-node": comm.stats.cross_node() - cross},
                          "calls": _calls(comm) - calls}
            comm.all_reduce(elapsed, op="max")  # after the stats: this timing all-reduce is not the step's
            res["losses"].append(loss)
            if k >= warmup:
                res["step_s"].append(elapsed.item())
    for engine, res in zip(engines, out):
        mesh = getattr(engine, "mesh", None)
        res["coords"] = [mesh.dp_rank, mesh.pp_rank, mesh.tp_rank] if mesh is not None else [comm.rank, 0, 0]
        res["planned"] = _planned(model_cfg, res["layout"], comm, node_size, global_batch, micro, res["coords"][1])
    return out
