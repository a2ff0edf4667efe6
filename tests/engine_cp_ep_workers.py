"""What tests/test_engine_cp_ep.py launches (never inside pytest): the context-parallel and MoE engine keys on 4 ranks,
in ONE job.

sequence: sequence_parallel_size 2 (dp 2 x cp 2, DeepSpeed-Ulysses in TinyGPT's attention) at ZeRO
stages 0-3, and ring attention (context_parallel.attention "ring", two mirrored chunks per rank) at stage 1, STEPS
SGD-momentum steps of M micro-batches with the clip active; per stage the losses (each
rank's mean over its s/cp tokens, averaged over dp x cp), the clip's norm and the full state dict.
experts: TinyGPT with MoE blocks (E experts, top-2, capacity factor 1: tokens dropped), ep_size 2 over
dp 4 (two ep groups, expert_dp of 2), stages 0 and 1; the losses, norms, each rank's own parameters and its
ep rank (the test joins the expert slices)."""
import torch

import minizero
from minizero.data import shard
from minizero_course.experiments.references import global_batches
from minizero.models import GPTConfig, TinyGPT

torch.set_num_threads(1)

GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
MOE = dict(GPT, num_experts=4, moe_ep_size=2, moe_top_k=2, moe_capacity_factor=1.0)
STEPS, MICRO, M = 3, 2, 2  # STEPS optimizer steps of M micro-batches of MICRO rows per data-parallel rank
CLIP = 0.05


def config(dp, stage, sp=1, attention="ulysses"):
    return {"context_parallel": {"attention": attention},"train_batch_size": MICRO * M * dp,
            "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": {"stage": stage}, "sequence_parallel_size": sp}


def micro_batches(step, dp, dp_rank):
    """This data-parallel rank's M micro-batches of `step` (the global batch is a pure function of the step)."""
    x, y = global_batches(TinyGPT(GPTConfig(**GPT)), step + 1, MICRO * M * dp, seed=7)[step]
    mine = shard((x, y), dp_rank, dp)
    return list(zip(mine[0].chunk(M), mine[1].chunk(M)))


def train(engine):
    losses, norms = [], []
    for step in range(STEPS):
        total = torch.zeros(1)
        for x, y in micro_batches(step, engine.dp_size, engine.dp_rank):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / M
        engine.dp_comm.all_reduce(total, op="avg")  # dp x cp ranks: the mean over every token
        losses.append(total.item())
        norms.append(engine.grad_norm)
    return losses, norms


def run(comm):
    out = {"sequence": {}}
    for stage in (0, 1, 2, 3, "ring"):  # "ring": context_parallel.attention ring at stage 1
        cfg = config(2, 1, sp=2, attention="ring") if stage == "ring" else config(2, stage, sp=2)
        engine = minizero.initialize(model=TinyGPT(GPTConfig(**GPT)), config=cfg, comm=comm).engine
        losses, norms = train(engine)
        full = engine.full_state_dict()
        out["sequence"][stage] = {"losses": losses, "norms": norms,
                                  "coords": [engine.mesh.dp_rank, engine.mesh.cp_rank],
                                  "dp_comm": engine.dp_comm.size, "dp_size": engine.dp_size,
                                  "state": {k: v.reshape(-1).tolist() for k, v in full.items()}}
    out["experts"] = {}
    for stage in (0, 1):
        engine = minizero.initialize(model=TinyGPT(GPTConfig(**MOE)), config=config(4, stage), comm=comm).engine
        losses, norms = train(engine)
        refused = None
        try:
            engine.save_checkpoint("/nonexistent")
        except NotImplementedError as e:
            refused = str(e)
        out["experts"][stage] = {
            "losses": losses, "norms": norms, "ep_rank": engine.mesh.ep_rank, "refused": refused,
            "params": {n: p.detach().reshape(-1).tolist() for n, p in engine.module.named_parameters()},
            "shapes": {n: list(p.shape) for n, p in engine.module.named_parameters()}}
    return out
