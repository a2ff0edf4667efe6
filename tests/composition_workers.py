"""What tests/test_composition.py launches: checkpoints of every parallel layout through one engine.

resume (8 ranks): for each layout (3D dp 2 x pp 2 x tp 2 with ZeRO-1; pp 2 with DDP; tp 2 with ZeRO-2
and with ZeRO-3; dp 8 with ZeRO-1), the same model and data three ways: STEPS steps straight; STEPS/2
steps, save; a fresh engine loads that checkpoint and trains STEPS/2 more. Per rank: the losses and a
SHA-256 of every tensor the rank steps (parameters and optimizer state) for the straight and the
resumed run, and where the final checkpoint went (tests/test_composition.py consolidates it).
reshard (4 ranks): the 3D checkpoint (saved at dp 2) loads at dp 1 x pp 2 x tp 2; the state dict right
after loading must equal the consolidated file."""
import hashlib
import os

import torch

import minizero
from minizero.data import shard
from minizero.models import GPTConfig, TinyGPT
from minizero.runtime import checkpoint

torch.set_num_threads(1)

GPT = dict(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, tie_weights=True)
STEPS, MICRO, M = 4, 2, 2  # STEPS optimizer steps of M micro-batches of MICRO rows per data-parallel rank
# name -> (zero stage, pipeline section or None, tp size)
LAYOUTS = {"3d_zero1": (1, {"stages": 2, "schedule": "1f1b"}, 2), "pp_ddp": (0, {"stages": 2, "schedule": "gpipe"}, 1),
           "tp_zero2": (2, None, 2), "tp_zero3": (3, None, 2), "dp_zero1": (1, None, 1)}


def config(layout, world):
    stage, pipeline, tp = LAYOUTS[layout]
    dp = world // ((pipeline or {"stages": 1})["stages"] * tp)
    cfg = {"train_batch_size": MICRO * M * dp, "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.05,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
           # warmup_min_lr > 0: DeepSpeed's WarmupLR runs steps 1 and 2 at the minimum, which must train too
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_min_lr": 0.05,
                                                        "warmup_max_lr": 0.1}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
           "tensor_parallel": {"autotp_size": tp}}
    if pipeline:
        cfg["pipeline"] = pipeline
    return cfg


def batches(step, dp):
    """The global batch of `step`: M micro-batches of MICRO x dp rows (a pure function of the step)."""
    from minizero_course.experiments.references import global_batches
    x, y = global_batches(TinyGPT(GPTConfig(**GPT)), step + 1, MICRO * M * dp, seed=5)[step]
    return x, y


def train(engine, steps):
    losses = []
    for _ in range(steps):
        x, y = batches(engine.global_steps, engine.dp_size)
        mine = shard((x, y), engine.dp_rank, engine.dp_size)
        micro = list(zip(mine[0].chunk(M), mine[1].chunk(M)))
        if hasattr(engine, "train_batch"):
            losses.append(engine.train_batch(iter(micro)).item())
            continue
        total = torch.zeros(1)
        for xm, ym in micro:
            loss = engine(xm, ym)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / M
        engine.dp_comm.all_reduce(total, op="avg")
        losses.append(total.item())
    return losses


def digest(engine) -> str:
    """SHA-256 of every tensor this rank steps: the fp32 masters and their optimizer state."""
    h = hashlib.sha256()
    for seg in checkpoint._segments(engine):
        h.update(seg.tensor.detach().numpy().tobytes())
        for v in sorted(seg.optimizer.state.get(seg.tensor, {}).items()):
            if torch.is_tensor(v[1]):
                h.update(v[1].numpy().tobytes())
    return h.hexdigest()


def make(comm, layout):
    return minizero.initialize(model=TinyGPT(GPTConfig(**GPT)), config=config(layout, comm.size), comm=comm).engine


def resume(comm, root):
    out = {}
    for layout in LAYOUTS:
        ckpt = os.path.join(root, layout)
        straight = make(comm, layout)
        losses = train(straight, STEPS)
        out[layout] = {"straight": losses, "straight_digest": digest(straight), "lr": straight.lr}
        straight.save_checkpoint(ckpt, tag="end")
        first = make(comm, layout)
        half = train(first, STEPS // 2)
        first.save_checkpoint(ckpt)
        resumed = make(comm, layout)
        resumed.load_checkpoint(ckpt)
        rest = train(resumed, STEPS - STEPS // 2)
        resumed.save_checkpoint(ckpt)  # `latest`: the resumed run's end (the test compares it with "end")
        out[layout].update(resumed=half + rest, resumed_digest=digest(resumed), resumed_lr=resumed.lr,
                           global_steps=resumed.global_steps, dir=ckpt,
                           coords=[resumed.dp_rank, getattr(resumed.mesh, "pp_rank", 0),
                                   getattr(resumed.mesh, "tp_rank", 0)])
        if layout == "3d_zero1":  # full_state_dict gathers the same thing consolidate reads from the files
            full = resumed.full_state_dict()  # a collective: every rank
            out[layout]["full"] = os.path.join(root, "3d_full.pt")
            if comm.rank == 0:
                torch.save(full, out[layout]["full"])
    out["offload_loops"] = offload_loops(comm)
    return out


def offload_loops(comm, steps=3):
    """A user's loop with offload as a constructor argument (zero.OffloadSpec), no engine: ZeRO-1, ZeRO-2 and
    ZeRO-3 with plain SGD, each against the same loop without offload (fused CPU SGD does the same float
    operations: the parameters must be bitwise equal), and the bytes the tier moved. Plain SGD because the
    two differ on purpose where a rank's piece of a parameter got an exactly zero gradient: torch (the
    device path) skips it, DeepSpeed's host step (the tier) steps every element, which momentum would move."""
    from minizero.zero import FSDP, FSDPOptimizer, OffloadSpec, ShardedOptimizer, ShardGradOp
    out = {}
    for name in ("zero1", "zero2", "zero3"):
        finals = []
        for spec in (None, OffloadSpec("cpu")):
            net = TinyGPT(GPTConfig(**GPT))
            kw = dict(lr=0.1)
            if name == "zero1":
                model, opt = net, ShardedOptimizer(net.parameters(), torch.optim.SGD, comm, offload=spec, **kw)
            elif name == "zero2":
                model = ShardGradOp(net, torch.optim.SGD, comm, offload=spec, **kw)
                opt = model
            else:
                model = FSDP(net, comm)
                opt = FSDPOptimizer(model, torch.optim.SGD, offload=spec, **kw)
            for step in range(steps):
                x, y = shard(batches(step, comm.size), comm.rank, comm.size)
                model(x, y)[1].backward()
                opt.step()
                opt.zero_grad()
            tier = getattr(opt, "tier", None) or getattr(getattr(opt, "optim", None), "tier", None)
            finals.append((torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                           tier.traffic.as_dict() if tier is not None else None,
                           sum(p.numel() * p.element_size() for p in tier.device_params) if tier is not None else 0))
        out[name] = {"bitwise": bool(torch.equal(finals[0][0], finals[1][0])), "traffic": finals[1][1],
                     "per_step": finals[1][2], "steps": steps}
    return out


def reshard(comm, root):
    """The 3D checkpoint saved at dp 2 loads at dp 1 (4 ranks); a tp 2 one refuses a tp 1 job."""
    engine = make(comm, "3d_zero1")
    engine.load_checkpoint(os.path.join(root, "3d_zero1"), tag="end")
    full = engine.full_state_dict()
    refused = None
    try:
        make(comm, "dp_zero1").load_checkpoint(os.path.join(root, "3d_zero1"), tag="end")
    except checkpoint.CheckpointError as e:
        refused = str(e)
    path = os.path.join(root, "3d_full_dp1.pt")
    if comm.rank == 0:
        torch.save(full, path)
    return {"full": path, "global_steps": engine.global_steps, "refused": refused}
