"""The planner against real runs of three features, in ONE launch (tests/test_planner_features.py):

  onebit    TinyGPT with optimizer.type OneBitAdam (freeze_step F) for STEPS steps: the bytes each step sends
            (comm.stats), their sum over the run, the ledger's model states and the two error buffers;
  sparse    TinyGPT with a sparse_attention section: memory.SavedTensors' peak over one forward, the
            planner given the layout's kept fraction of the scores (sparse.score_bytes over heads·s²);
  moe       TinyGPT with MoE blocks at ZeRO stage 0, ep_size 1 (DDP: buckets and .grad) and ep_size N
            (ExpertDDPStrategy: the .grad alone): the ledger's gradients.
The planner never sees a measured number; the test compares them.
"""
from __future__ import annotations

from minizero.data import SyntheticTokens, shard
from minizero.memory import SavedTensors
from minizero.models import build_model
from minizero.planner import ModelShape, ParallelStrategy, plan
from minizero.runtime.engine import build_engine

GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=False)
SPARSE = {"mode": "fixed", "block": 4, "num_local_blocks": 2, "num_global_blocks": 1, "attention": "unidirectional"}
MOE = dict(num_experts=4, moe_top_k=2, moe_capacity_factor=1.0)
FREEZE_STEP, STEPS, MICRO = 2, 5, 2


def _shape(**kw) -> ModelShape:
    return ModelShape(GPT["n_layer"], GPT["n_embd"], GPT["n_head"], GPT["block_size"], GPT["vocab_size"],
                      GPT["tie_weights"], **kw)


def _config(optimizer: dict, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "optimizer": optimizer,
            "zero_optimization": {"stage": 0}, **extra}


def _batch(engine, step):
    data = SyntheticTokens(GPT["vocab_size"], GPT["block_size"])
    return shard(data.batch(step, MICRO * engine.dp_size), engine.dp_rank, engine.dp_size)


def onebit(comm) -> dict:
    cfg = _config({"type": "OneBitAdam", "params": {"lr": 3e-3, "freeze_step": FREEZE_STEP}})
    engine = build_engine(build_model("tiny-gpt", seed=0, **GPT), cfg, comm)
    sent = []
    for step in range(STEPS):
        comm.stats.reset()
        engine.backward(engine(*_batch(engine, step)))
        if step == STEPS - 1:
            ledger = engine.memory().detail  # gradients and optimizer state both alive
        engine.step()
        sent.append(comm.stats.sent())
    errors = sum(e.numel() * e.element_size() for pair in engine.optimizer._error_buffers.values() for e in pair)
    p = plan(_shape(), ParallelStrategy(comm.size, zero=0, micro_batch=MICRO, precision="fp32", optimizer="onebitadam",
                                freeze_step=FREEZE_STEP, steps=STEPS)).stages[0]
    return {"measured": {"sent": sent, "ledger": ledger, "errors": errors},
            "planned": {"onebit": p.onebit, "sent": p.sent, "memory": p.memory}}


def sparse(comm) -> dict:
    from minizero.sparse import from_section, score_bytes
    peaks = {}
    for name, extra in (("sparse", {"sparse_attention": SPARSE}), ("dense", {})):
        engine = build_engine(build_model("tiny-gpt", seed=0, **GPT),
                              _config({"type": "SGD", "params": {"lr": 0.05}}, **extra), comm)
        meter = SavedTensors(exclude=list(engine.module.parameters()))
        with meter.hooks():
            loss = engine(*_batch(engine, 0))
        engine.backward(loss)
        peaks[name] = meter.peak
    layout = from_section(SPARSE, GPT["n_head"]).make_layout(GPT["block_size"])
    fraction = score_bytes(layout, 1, SPARSE["block"], 1, causal=True) / (GPT["n_head"] * GPT["block_size"] ** 2)
    planned = {}
    for name, density in (("sparse", fraction), ("dense", 1.0)):
        p = plan(_shape(attention_density=density),
                 ParallelStrategy(comm.size, zero=0, micro_batch=MICRO, precision="fp32",
                                  optimizer="sgd"))
        planned[name] = p.stages[0].memory["activations"]
    return {"measured": {"activations": peaks["sparse"], "dense_activations": peaks["dense"],
                         "nnz": int(layout.tril().sum())},
            "planned": {"fraction": fraction, **planned}}


def moe(comm) -> dict:
    out = {}
    for ep in (1, comm.size):
        engine = build_engine(build_model("tiny-gpt", seed=0, **GPT, **MOE, moe_ep_size=ep),
                              _config({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}), comm)
        for step in range(2):  # the second step's: every buffer exists
            engine.backward(engine(*_batch(engine, step)))
            if step == 1:
                ledger = engine.memory().detail
            engine.step()
        shape = _shape(experts=MOE["num_experts"], top_k=MOE["moe_top_k"], capacity_factor=MOE["moe_capacity_factor"])
        p = plan(shape, ParallelStrategy(comm.size, zero=0, micro_batch=MICRO, precision="fp32",
                                         optimizer="sgd", ep=ep))
        out[f"ep{ep}"] = {"measured": ledger, "planned": p.stages[0].memory}
    return out


def validate(comm) -> dict:
    return {"onebit": onebit(comm), "sparse": sparse(comm), "moe": moe(comm)}

