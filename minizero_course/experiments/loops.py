"""The few lines a student writes to train with each strategy, as the lessons show them.

Each function is a complete training loop on this rank's shard of the same global batches of
TinyGPT, and returns the loss of every step. The lessons print their source
(`inspect.getsource`) and run them inside the jobs they launch anyway, so what a notebook shows
is what ran. Put two side by side and the strategy is the line that differs: DDP needs a call
after backward, ZeRO-1 swaps the optimizer, ZeRO-2 and ZeRO-3 wrap the model, ZeRO++ wraps it with a
Mesh of nodes, and offload, pipeline and tensor parallelism are a section of the engine's config.
"""
import difflib
import inspect

import torch

from minizero.comm import Mesh
from minizero.data import shard
from minizero.dp.data_parallel import DataParallel
from minizero.dp.ddp import DDP
from minizero_course.experiments.references import global_batches
from minizero.models import build_model
from minizero.precision import LossScaler, MixedPrecisionOptimizer, fp32_loss
from minizero.runtime.initialize import initialize
from minizero.zero.fsdp import FSDP
from minizero.zero.shard_grad_op import ShardGradOp
from minizero.zero.sharded_optimizer import ShardedOptimizer
from minizero.zero.zeropp import ZeroPP

STEPS, BATCH_PER_RANK, LR = 5, 4, 3e-3


def data_parallel(comm=None, steps=STEPS, replicas=2):
    net = build_model("tiny-gpt", seed=0)                 # ONE process holds every replica
    model = DataParallel(net, replicas)                   # DataParallel: n copies of the model
    opt = torch.optim.Adam(model.module.parameters(), lr=LR)  # steps replica 0 only
    losses = []
    for x, y in global_batches(net, steps, BATCH_PER_RANK * replicas):
        loss = model(x, y)[1]                             # each replica runs its slice, one after another
        loss.backward()
        model.reduce_gradients()                          # every replica's gradient into replica 0
        opt.step()
        opt.zero_grad()
        model.sync_replicas()                             # replica 0's new weights out to the others
        losses.append(loss.item())
    return losses


def ddp(comm, steps=STEPS):
    net = build_model("tiny-gpt", seed=0)                 # the same weights on every rank
    model = DDP(net, comm)                                # DDP: wrap the model
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for batch in global_batches(net, steps, BATCH_PER_RANK * comm.size):
        x, y = shard(batch, comm.rank, comm.size)         # this rank's slice of the global batch
        loss = model(x, y)[1]
        loss.backward()
        model.finish_gradient_synchronization()           # DDP: wait for the all-reduces, divide by N
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def mixed_precision(comm, steps=STEPS):
    net = build_model("tiny-gpt", seed=0).to(torch.float16)  # 16-bit weights, so 16-bit gradients
    opt = MixedPrecisionOptimizer(net.parameters(), torch.optim.Adam, LossScaler(), comm=comm, lr=LR)
    losses = []
    for x, y in global_batches(net, steps, BATCH_PER_RANK):
        loss = fp32_loss(net, x, y)                       # softmax and mean in fp32
        opt.backward(loss)                                # backward of loss * scale
        opt.step()                                        # unscale; skip on inf/nan, else step the fp32 masters
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def zero1(comm, steps=STEPS):
    net = build_model("tiny-gpt", seed=0)                 # the same weights on every rank
    model = net                                           # ZeRO-1: the model stays as it is
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, comm, lr=LR)  # ZeRO-1: Adam on 1/N
    losses = []
    for batch in global_batches(net, steps, BATCH_PER_RANK * comm.size):
        x, y = shard(batch, comm.rank, comm.size)         # this rank's slice of the global batch
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def zero2(comm, steps=STEPS):
    net = build_model("tiny-gpt", seed=0)                 # the same weights on every rank
    model = ShardGradOp(net, torch.optim.Adam, comm, lr=LR)  # ZeRO-2: wraps the model, owns Adam on 1/N
    opt = model                                           # ZeRO-2: step() and zero_grad() are the wrapper's
    losses = []
    for batch in global_batches(net, steps, BATCH_PER_RANK * comm.size):
        x, y = shard(batch, comm.rank, comm.size)         # this rank's slice of the global batch
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def zero3(comm, steps=STEPS):
    net = build_model("tiny-gpt", seed=0)                 # the same weights on every rank
    model = FSDP(net, comm)                               # ZeRO-3: parameters sharded, gathered per unit
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for batch in global_batches(net, steps, BATCH_PER_RANK * comm.size):
        x, y = shard(batch, comm.rank, comm.size)         # this rank's slice of the global batch
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def zero2_offload(comm, steps=STEPS):
    net = build_model("tiny-gpt", seed=0)                 # the same weights on every rank
    config = {"train_micro_batch_size_per_gpu": BATCH_PER_RANK,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": {"stage": 2,
                                    # ZeRO-Offload: master, Adam and step on the host
                                    "offload_optimizer": {"device": "cpu"}}}
    # DeepSpeed's call (engine, optimizer, ...): the engine wraps
    engine, _, _, _ = initialize(model=net, config=config, comm=comm)
    # the model and builds the optimizer (runtime/engine.py)
    losses = []
    for batch in global_batches(net, steps, BATCH_PER_RANK * comm.size):
        x, y = shard(batch, comm.rank, comm.size)         # this rank's slice of the global batch
        loss = engine(x, y)
        engine.backward(loss)                             # gradients reduced into this rank's shard, then to the host
        engine.step()                                     # the CPU step; the new parameters come back up
        losses.append(loss.item())
    return losses


def zeropp(comm, steps=STEPS):
    net = build_model("tiny-gpt", seed=0)                 # the same weights on every rank
    mesh = Mesh(comm, node_size=2)                        # ZeRO++: ranks grouped into (simulated) nodes of 2
    model = ZeroPP(net, mesh)                             # ZeRO-3 + int8 weights, hpZ inside a node, int4 gradients
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for batch in global_batches(net, steps, BATCH_PER_RANK * comm.size):
        x, y = shard(batch, comm.rank, comm.size)         # this rank's slice of the global batch
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def pipeline(comm, steps=STEPS):
    net = build_model("tiny-gpt", seed=0, n_layer=comm.size)  # one block per stage
    config = {"train_batch_size": BATCH_PER_RANK * comm.size, "train_micro_batch_size_per_gpu": 2,
              "gradient_clipping": 0.0, "optimizer": {"type": "Adam", "params": {"lr": LR}},
              "pipeline": {"stages": comm.size, "schedule": "1f1b"}}  # PP: every rank one stage, 1F1B
    engine, _, _, _ = initialize(model=net, config=config, comm=comm)  # each rank keeps only its stage's blocks
    losses = []
    for x, y in global_batches(net, steps, BATCH_PER_RANK * comm.size):
        micro_batches = zip(x.split(2), y.split(2))       # the WHOLE batch: the pipeline cuts it in micro-batches
        loss = engine.train_batch(micro_batches)          # F and B of every micro-batch in 1F1B order, then the step
        losses.append(loss.item())
    return losses


def tensor_parallel(comm, steps=STEPS):
    net = build_model("tiny-gpt", seed=0)                 # the same weights on every rank
    config = {"train_micro_batch_size_per_gpu": BATCH_PER_RANK * comm.size, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": LR}},
              "tensor_parallel": {"autotp_size": comm.size}}  # TP: every layer split over all ranks
    engine, _, _, _ = initialize(model=net, config=config, comm=comm)  # the model now holds this rank's slices
    losses = []
    for x, y in global_batches(net, steps, BATCH_PER_RANK * comm.size):
        loss = engine(x, y)                               # EVERY rank the same rows: they share each layer
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def all_strategies(comm, names=("ddp", "zero1", "zero2", "zero3"), steps=STEPS):
    """{name: losses of this rank} for several loops, in one launch."""
    return {name: globals()[name](comm, steps=steps) for name in names}


def show(name: str, against: str | None = None) -> str:
    """The source of loop `name`, and, with `against`, the lines in which it differs from that one."""
    text = inspect.getsource(globals()[name])
    if against is None:
        return text
    base = inspect.getsource(globals()[against]).splitlines(keepends=True)
    diff = difflib.unified_diff(base, text.splitlines(keepends=True), against, name, n=0)
    return text + f"\n--- what changes from `{against}` to `{name}`:\n" + "".join(
        line for line in diff if not line.startswith(("---", "+++", "@@")))
