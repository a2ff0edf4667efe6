"""What tests/test_zeropp.py runs through minizero.launch (never inside pytest).

`main` (4 ranks as 2 nodes x 2) does everything in one job: the byte accounting against hand
numbers, the traffic of every variant, ZeroPP against FSDP and against a model whose weights were
quantized by hand, the quantization errors, a short convergence run, the hpZ warning, an engine
resumed from a checkpoint with hpZ on, and odd sizes and node counts on 3 of the ranks."""
import warnings

import torch

from minizero.comm import Mesh
from minizero.data import shard
from minizero_course.experiments import zeropp as experiment
from minizero_course.experiments.references import global_batches
from minizero.models import build_model
from minizero.runtime.engine import build_engine
from minizero.zero.fsdp import FSDP
from minizero.zero.quantize import dequantize_blockwise, quantize_blockwise
from minizero.zero.zeropp import ZeroPP

torch.set_num_threads(1)
GPT = experiment.LESSON_GPT
PERSISTENCE_THRESHOLD = 2100


def stats_split(comm):
    """One op of each kind on the world, a node, a cross-node group and a new group, after a
    Mesh of 2 nodes x 2: {op: [sent, cross]} from the world's stats, and the same from the groups'."""
    mesh = Mesh(comm, node_size=2)
    comm.stats.reset()
    comm.all_gather(torch.empty(100), torch.ones(25))          # payload 400 B
    comm.all_to_all(torch.empty(100), torch.ones(100))         # payload 400 B
    mesh.node.all_reduce(torch.ones(40))                       # payload 160 B, 2 ranks
    mesh.cross_node.reduce_scatter(torch.empty(10), torch.ones(20))  # payload 80 B, 2 ranks
    pair = comm.new_group([0, 2])                              # world ranks 0 and 2: nodes 0 and 1
    if pair is not None:
        pair.broadcast(torch.ones(10))                         # payload 40 B
    send = comm.isend(torch.ones(5), (comm.rank + 1) % comm.size)  # 20 B to the next world rank
    comm.recv(torch.empty(5), (comm.rank - 1) % comm.size)
    send.wait()
    world = {op: [s["sent_bytes"], s["cross_node_bytes"]] for op, s in comm.stats.as_dict().items()}
    groups = {"node": mesh.node.stats.cross_node(), "cross_node": mesh.cross_node.stats.cross_node(),
              "node_sent": mesh.node.stats.sent()}
    return {"world": world, "groups": groups, "total_cross": comm.stats.cross_node(),
            "total_intra": comm.stats.intra_node()}


def _train(comm, wrapper, net, steps, lr=0.1):
    opt = torch.optim.SGD(wrapper.parameters(), lr=lr, momentum=0.9)
    losses = []
    for batch in global_batches(net, steps, 8):
        x, y = shard(batch, comm.rank, comm.size)
        loss = wrapper(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, torch.cat([v.reshape(-1) for v in wrapper.gather_full_params().values()])


def against_fsdp(comm, mesh, steps=3):
    """ZeroPP with everything off and with hpZ only must equal FSDP bitwise (hpZ changes where
    backward gathers from, not the values); qwZ and qgZ must stay close."""
    runs = {"fsdp": None, "off": dict(quantized_weights=False, hpz=False, quantized_gradients=False),
            "hpz": dict(quantized_weights=False, hpz=True, quantized_gradients=False),
            "qwz": dict(quantized_weights=True, hpz=False, quantized_gradients=False),
            "qgz": dict(quantized_weights=False, hpz=False, quantized_gradients=True)}
    out = {}
    for name, flags in runs.items():
        net = build_model("tiny-gpt", seed=0, **GPT)
        w = FSDP(net, comm) if flags is None else ZeroPP(net, mesh, **flags)
        out[name] = _train(comm, w, net, steps)
    ref_losses, ref_params = out["fsdp"]
    return {name: {"losses_equal": losses == ref_losses, "params_bitwise": bool(torch.equal(params, ref_params)),
                   "max_param_diff": float((params - ref_params).abs().max()),
                   "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses))}
            for name, (losses, params) in out.items()}


def qwz_forward_by_hand(comm, mesh, block=256):
    """qwZ's first loss against a plain model whose weights were quantized by hand: each unit
    flattened and padded, each rank's shard quantized in blocks and dequantized."""
    net = build_model("tiny-gpt", seed=0, **GPT)
    w = ZeroPP(net, mesh, quantized_weights=True, hpz=False, quantized_gradients=False, weight_block_numel=block)
    full = w.gather_full_params()
    plain = build_model("tiny-gpt", seed=0, **GPT)
    params = dict(plain.named_parameters())
    worst = 0.0
    with torch.no_grad():
        for unit in w.units:
            flat = unit.layout.flatten([full[names[0]] for _, _, names in unit.entries])
            shards = flat.view(comm.size, -1)
            codes, scales = quantize_blockwise(shards, block)
            deq = dequantize_blockwise(codes, scales, block).reshape(-1)
            bound = scales.repeat_interleave(block, dim=1)[:, :shards.shape[1]].reshape(-1) / 2
            worst = max(worst, float(((flat - deq).abs() - bound).max()))
            for (_, _, names), v in zip(unit.entries, unit.split(deq)):
                params[names[0]].copy_(v)
    x, y = shard(global_batches(net, 1, 8)[0], comm.rank, comm.size)
    loss = w(x, y)[1]
    loss.backward()
    err = w.quantization_error()["weights"]
    return {"loss": loss.item(), "by_hand": plain(x, y)[1].item(), "over_bound": worst, "weight_error": err}


def qgz_error(comm, mesh):
    """One backward of qgZ with measure_error: the relative L2 error of the shard gradients."""
    net = build_model("tiny-gpt", seed=0, **GPT)
    w = ZeroPP(net, mesh, quantized_weights=False, hpz=False, quantized_gradients=True, measure_error=True)
    x, y = shard(global_batches(net, 1, 8)[0], comm.rank, comm.size)
    w(x, y)[1].backward()
    return w.quantization_error()["gradients"]


def node_size_one_warns(comm):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = ZeroPP(build_model("tiny-gpt", seed=0, **GPT), Mesh(comm, node_size=1))
    return {"messages": [str(c.message) for c in caught], "hpz": w.hpz, "secondary": len(w.secondary)}


def resume(comm, ckpt_dir, steps=6, save_at=3):
    """Engine with qwZ + hpZ (2 per node) + qgZ, Adam: 6 steps straight, saving after step 3; a fresh
    engine resumed from it; and the first engine itself reloaded after it trained on (its
    secondary partitions then hold newer weights than the checkpoint: they must be rebuilt)."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "zero_quantized_weights": True,
                                 "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}}
    batches = global_batches(build_model("tiny-gpt", seed=0, **GPT), steps, 2 * comm.size)

    def train(engine, first):
        losses = []
        for batch in batches[first:]:
            loss = engine(*shard(batch, comm.rank, comm.size))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if engine.global_steps == save_at and first == 0:
                engine.save_checkpoint(ckpt_dir)
        return losses, torch.cat([v.reshape(-1) for v in engine.full_state_dict().values()])

    first = build_engine(build_model("tiny-gpt", seed=0, **GPT), cfg, comm)
    straight, params = train(first, 0)
    fresh = build_engine(build_model("tiny-gpt", seed=0, **GPT), cfg, comm)
    fresh.load_checkpoint(ckpt_dir)
    resumed, resumed_params = train(fresh, save_at)
    first.load_checkpoint(ckpt_dir)
    again, again_params = train(first, save_at)
    return {"wrapper": type(first.wrapped).__name__, "hpz": first.wrapped.hpz, "node_size": first.node_mesh.node_size,
            "straight": straight[save_at:], "resumed": resumed, "reloaded": again,
            "params_bitwise": bool(torch.equal(params, resumed_params)),
            "reloaded_bitwise": bool(torch.equal(params, again_params))}


def odd(comm):
    """Ranks 0-2 as 3 nodes of 1 and as 1 node of 3, the 209-element edge model (tied, frozen and unused
    parameters; padding; int4 rows of odd length): traffic of every variant, fp32. Rank 3 waits."""
    import time

    from mpi4py import MPI
    sub = comm.new_group([0, 1, 2], name="first3")
    out = {k: experiment.traffic(sub, k, "fp32", model="edge", steps=2) for k in (1, 3)} if sub is not None else None
    req = MPI.COMM_WORLD.Ibarrier()
    while not req.Test():  # sleep, not spin: the 2 cores belong to the ranks that work
        time.sleep(0.002)
    return out


def main(comm, ckpt_dir, steps=30):
    out = {"stats": stats_split(comm)}
    out["traffic"] = experiment.traffic(comm, 2, "fp16", model_kwargs=GPT, steps=1)
    out["traffic_fp32"] = experiment.traffic(comm, 2, "fp32", model_kwargs=GPT, variants=("ZeRO-3", "+hpZ"), steps=1)
    # tensors under 2100 elements kept whole: the root unit (embeddings, head, final norm) entirely, and each
    # block's norms, biases and 1024-element projection; its other weights sharded
    out["traffic_persistent"] = experiment.traffic(comm, 2, "fp16", model_kwargs=GPT, steps=1,
                                                   persistence_threshold=PERSISTENCE_THRESHOLD)
    mesh = Mesh(comm, node_size=2)
    out["against_fsdp"] = against_fsdp(comm, mesh)
    out["qwz"] = qwz_forward_by_hand(comm, mesh)
    out["qgz_error"] = qgz_error(comm, mesh)
    # +hpZ trains bitwise like ZeRO-3 (against_fsdp); the model as one unit: fewer collectives per step
    conv = experiment.convergence(comm, 2, steps, variants=("ZeRO-3", "+qwZ", "+qgZ", "ZeRO++"), error_every=10 ** 9,
                                  wrap=experiment.one_unit)
    out["convergence"] = {name: r["loss"] for name, r in conv.items()}
    out["warn"] = node_size_one_warns(comm)
    out["odd"] = odd(comm)
    out["resume"] = resume(comm, ckpt_dir)
    return out


