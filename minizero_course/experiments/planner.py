"""The planner checked against real runs: many small configurations in ONE launch.

`validate(comm, configs)` trains TinyGPT through minizero.initialize for each configuration (a
DeepSpeed config built from a planner ParallelStrategy) and returns, per configuration, what the planner
predicts next to what the run measured on each rank:
  * model states: the ledger (engine.memory(), real tensors) by category and location, after the
    last backward of the second step (gradients and optimizer state both alive);
  * bytes sent in one optimizer step: comm.stats (counted where each collective is called);
  * activations: memory.SavedTensors' peak over one forward (ZeRO-3 excluded: its own saved-tensor
    hooks are the innermost ones there, so a meter outside sees nothing).
The planner never sees a measured number; the test compares them. The same runs serve activation
checkpointing's test: each configuration with and without it ends with the same parameters (a
SHA-256 of the trained state) and sends the same bytes.
"""
from __future__ import annotations

import hashlib

import torch

from minizero.activation_checkpointing import checkpointed
from minizero.data import SyntheticTokens, shard
from minizero.memory import SavedTensors
from minizero.models import build_model
from minizero.planner import ModelShape, ParallelStrategy, plan
from minizero.runtime.engine import build_engine

# small enough for 2 cores; two widths, layer counts, vocabularies, tied and untied
SHAPES = {"a": dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=False),
          "b": dict(vocab_size=48, block_size=8, n_layer=3, n_head=4, n_embd=24, tie_weights=True)}


def configurations() -> list[dict]:
    """ZeRO 0-3, with and without checkpointing, offload at 1-3, TP 2 with and without SP and checkpointing,
    two shapes, 1-2 micro-batches."""
    out = []
    for shape in SHAPES:
        for zero in range(4):
            for ckpt in (False, True):
                out.append({"shape": shape, "zero": zero, "checkpointing": ckpt, "micro_batches": 1 + (zero == 2)})
        for zero in (1, 2, 3):
            out.append({"shape": shape, "zero": zero, "offload": True, "micro_batches": 1})
        for sp, ckpt in ((False, False), (True, False), (False, True), (True, True)):
            out.append({"shape": shape, "zero": 1, "tp": 2, "sp": sp, "checkpointing": ckpt, "micro_batches": 1})
    return out


def shape_of(name: str) -> ModelShape:
    g = SHAPES[name]
    return ModelShape(g["n_layer"], g["n_embd"], g["n_head"], g["block_size"], g["vocab_size"], g["tie_weights"])


def strategy_of(c: dict, world: int, node_size: int, micro_batch: int) -> ParallelStrategy:
    return ParallelStrategy(world, node_size, tp=c.get("tp", 1), sp=c.get("sp", False), zero=c["zero"],
                    offload=c.get("offload", False), micro_batch=micro_batch,
                    micro_batches=c["micro_batches"], checkpointing=c.get("checkpointing", False),
                    precision="fp32", optimizer="sgd")


def ds_config(c: dict, micro_batch: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": c["micro_batches"],
           "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
           "zero_optimization": {"stage": c["zero"], "stage3_param_persistence_threshold": 0}}
    if c.get("offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if c.get("checkpointing"):
        cfg["activation_checkpointing"] = {}
    if c.get("tp"):
        cfg["tensor_parallel"] = {"autotp_size": c["tp"], "sequence_parallel": c.get("sp", False)}
    return cfg


def run_one(comm, c: dict, micro_batch: int = 2) -> dict:
    g = SHAPES[c["shape"]]
    engine = build_engine(build_model("tiny-gpt", seed=0, **g), ds_config(c, micro_batch), comm)
    data = SyntheticTokens(g["vocab_size"], g["block_size"])
    sent = activations = None
    for step in range(2):  # the second step is measured: every buffer exists, the state too
        comm.stats.reset()
        for micro in range(c["micro_batches"]):
            n, r = engine.dp_size, engine.dp_rank  # with TP the tp ranks of a group share their rows
            x, y = shard(data.batch(step * 8 + micro, micro_batch * n), r, n)
            meter = SavedTensors(exclude=list(engine.module.parameters()))
            with meter.hooks():
                loss = engine(x, y)
            activations = meter.peak
            engine.backward(loss)
            if step == 1 and micro == c["micro_batches"] - 1:
                ledger = engine.memory()  # after the last backward: gradients and optimizer state both alive
            engine.step()
        sent = comm.stats.sent()
    # the trained parameters, fingerprinted (equal runs, equal bits); with TP each rank's own slices
    params = engine.full_state_dict() if engine.mesh is None else engine.module.state_dict()
    digest = hashlib.sha256(torch.cat([v.reshape(-1).float() for v in params.values()]).numpy().tobytes())
    return {"ledger": ledger.detail, "sent": sent, "activations": activations if c["zero"] != 3 else None,
            "params_sha256": digest.hexdigest(),
            "recomputes": {name: f.recomputes for name, f in checkpointed(engine.module).items()}}


def validate(comm, configs=None, micro_batch: int = 2, node_size: int = 2) -> list[dict]:
    """Predicted vs measured for each configuration (see the module docstring)."""
    out = []
    for c in configs or configurations():
        p = plan(shape_of(c["shape"]), strategy_of(c, comm.size, node_size, micro_batch))
        stage = p.stages[0]
        out.append({"config": c, "name": p.strategy.name(), "measured": run_one(comm, c, micro_batch),
                    "planned": {"memory": stage.memory, "host": stage.host, "sent": sum(stage.sent.values()),
                                "params": stage.params}})
    return out
