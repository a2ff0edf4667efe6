"""Hybrid sharding through the engine (zero_optimization.mics_shard_size, DeepSpeed's MiCS key), on 4 ranks
as 2 groups of 2: against zero.HybridShard driven by hand, against plain ZeRO-3 with clipping, and resumed."""
import torch

from minizero.comm import Mesh
from minizero.data import shard
from minizero_course.experiments.references import global_batches
from minizero.models import build_model
from minizero.runtime.engine import build_engine
from minizero.runtime.resolve import optimizer_spec
from minizero.zero.fsdp_optimizer import FSDPOptimizer
from minizero.zero.hybrid import HybridShard

torch.set_num_threads(1)
GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
OPT = {"type": "AdamW", "params": {"lr": 3e-3}}
STEPS, SAVE_AT = 6, 3


def _config(mics=2, clip=0.0):
    zero = {"stage": 3, "stage3_param_persistence_threshold": 1000}  # blocks sharded, norms and biases whole
    if mics:
        zero["mics_shard_size"] = mics
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": clip, "optimizer": OPT,
            "zero_optimization": zero}


def _train(comm, engine, batches, first=0, ckpt_dir=None):
    losses, norms = [], []
    for batch in batches[first:]:
        loss = engine(*shard(batch, comm.rank, comm.size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
        if ckpt_dir is not None and engine.global_steps == SAVE_AT and first == 0:
            engine.save_checkpoint(ckpt_dir)
    flat = torch.cat([v.reshape(-1) for v in engine.full_state_dict().values()])
    return losses, norms, flat


def engine(comm, ckpt_dir):
    batches = global_batches(build_model("tiny-gpt", seed=0, **GPT), STEPS, 2 * comm.size)
    out = {}
    hybrid = build_engine(build_model("tiny-gpt", seed=0, **GPT), _config(), comm)
    out["wrapper"], out["strategy"] = type(hybrid.wrapped).__name__, type(hybrid.strategy).__name__
    out["node_size"] = hybrid.node_mesh.node_size
    sharded = [u for u in hybrid.wrapped.units if u.shard is not None]
    out["shard_numel"] = sum(u.shard.numel() for u in sharded)
    out["gathered_numel"] = sum(u.gathered_numel for u in sharded)
    losses, _, flat = _train(comm, hybrid, batches, ckpt_dir=ckpt_dir)
    out["losses"] = losses

    # zero.HybridShard alone, as its docstring drives it, with the engine's optimizer
    cls, kw = optimizer_spec(OPT)
    model = HybridShard(build_model("tiny-gpt", seed=0, **GPT), Mesh(comm, node_size=2), prefetch=True,
                        persistence_threshold=1000)
    opt = FSDPOptimizer(model, cls, **kw)
    alone = []
    for batch in batches:
        loss = model(*shard(batch, comm.rank, comm.size))[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        alone.append(loss.item())
    out["alone"] = alone

    # resumed from the checkpoint saved after step 3: a fresh engine, and plain ZeRO-3 (resharded over 4)
    fresh = build_engine(build_model("tiny-gpt", seed=0, **GPT), _config(), comm)
    fresh.load_checkpoint(ckpt_dir)
    resumed, _, resumed_flat = _train(comm, fresh, batches, first=SAVE_AT)
    out["resumed"], out["resumed_bitwise"] = resumed, bool(torch.equal(flat, resumed_flat))
    zero3 = build_engine(build_model("tiny-gpt", seed=0, **GPT), _config(mics=0), comm)
    zero3.load_checkpoint(ckpt_dir)
    out["zero3_loaded"] = _train(comm, zero3, batches, first=SAVE_AT)[0]

    # the clip's norm: the shards' squares add up over a group, not the world (each group holds the model)
    clipped = _train(comm, build_engine(build_model("tiny-gpt", seed=0, **GPT), _config(clip=0.05), comm), batches)
    plain = _train(comm, build_engine(build_model("tiny-gpt", seed=0, **GPT), _config(mics=0, clip=0.05), comm),
                   batches)
    out["clipped"], out["plain_clipped"] = clipped[:2], plain[:2]
    return out
