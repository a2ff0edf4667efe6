"""Lesson 08's measurements (and lab 08's, and the tests'): ZeRO++ against ZeRO-3 across simulated nodes.

    traffic      bytes each rank sends per step, by phase and op, intra- vs cross-node (comm.stats),
                 and the ledger, for every variant; one job, any world and node size
    formula      what the ring model predicts for the same step, from the units' padded sizes
                 alone (never from comm.stats): the table the measurement is held against
    convergence  every variant trained side by side for many steps: losses, step times, the
                 quantization error per step
    lesson       one 4-rank job for the notebook: all of the above, plus a ping-pong for alpha-beta
"""
from __future__ import annotations

import time

import torch

from minizero import memory
from minizero.comm import Mesh
from minizero.data import shard
from minizero_course.experiments.references import global_batches
from minizero.models import build_model
from minizero.zero.fsdp import FSDP
from minizero.zero.zeropp import ZeroPP, bytes_per_rank

# name -> ZeroPP's switches; None: plain ZeRO-3 (FSDP)
VARIANTS = {
    "ZeRO-3": None,
    "+qwZ": dict(quantized_weights=True, hpz=False, quantized_gradients=False),
    "+hpZ": dict(quantized_weights=False, hpz=True, quantized_gradients=False),
    "+qgZ": dict(quantized_weights=False, hpz=False, quantized_gradients=True),
    "ZeRO++": dict(quantized_weights=True, hpz=True, quantized_gradients=True),
}
LESSON_GPT = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)  # vocab 64: a unit per block + the root
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build(variant, model, mesh, dtype="fp32", wrap=None, persistence_threshold=0, **zeropp_kw):
    """`variant`'s wrapper around `model`; every parameter sharded unless persistence_threshold > 0."""
    compute = DTYPES[dtype]
    flags = VARIANTS[variant]
    # No per-forward buffer broadcast (torch DDP's broadcast_buffers, FSDP's default): these models' buffers
    # never change, and bytes outside the ZeRO-3 / ZeRO++ formulas would blur the comparison with them.
    if flags is None:
        return FSDP(model, mesh.world, compute_dtype=compute, wrap=wrap, broadcast_buffers=False,
                    persistence_threshold=persistence_threshold)
    return ZeroPP(model, mesh, compute_dtype=compute, wrap=wrap, broadcast_buffers=False,
                  persistence_threshold=persistence_threshold, **flags, **zeropp_kw)


def one_unit(name, module):
    """wrap= for FSDP: no inner units, the whole model is one flat unit (fewest collectives per step)."""
    return False


def _split(comm):
    """{op: [intra, cross]} bytes this rank sent since the last reset."""
    return {op: [s["sent_bytes"] - s["cross_node_bytes"], s["cross_node_bytes"]]
            for op, s in comm.stats.as_dict().items() if s["sent_bytes"]}


# ----------------------------------------------------------------------------- bytes per step
def traffic(comm, node_size=2, dtype="fp16", model="tiny-gpt", model_kwargs=None, steps=2, micro=2,
            weight_block_numel=2048, grad_block_numel=512, variants=tuple(VARIANTS), wrap=None,
            persistence_threshold=0):
    """For each variant: this rank's bytes of the last of `steps` steps, {"forward"|"backward":
    {op: [intra, cross]}}, its ledger after backward, the units' padded sizes, the loss."""
    torch.set_num_threads(1)
    mesh = Mesh(comm, node_size=node_size)
    out = {"N": comm.size, "k": node_size, "dtype": dtype, "variants": {},
           "block_numel": {"weights": weight_block_numel, "gradients": grad_block_numel}}  # elements per fp32 scale
    for name in variants:
        net = build_model(model, seed=0, **(model_kwargs or {}))
        w = build(name, net, mesh, dtype, wrap, persistence_threshold, weight_block_numel=weight_block_numel,
                  grad_block_numel=grad_block_numel)
        opt = torch.optim.SGD(w.parameters(), lr=0.05)
        for batch in global_batches(net, steps, micro * comm.size):
            x, y = shard(batch, comm.rank, comm.size)
            comm.stats.reset()
            loss = w(x, y)[1]
            fwd = _split(comm)
            comm.stats.reset()
            loss.backward()
            bwd = _split(comm)
            ledger = memory.measure(w).by_category
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["variants"][name] = {"forward": fwd, "backward": bwd, "ledger": ledger, "loss": loss.item(),
                                 "error": w.quantization_error() if isinstance(w, ZeroPP) else {}}
        out["padded"] = [u.gathered_numel for u in w.units]  # elements gathered per unit (Ψ + padding)
        out["psi"] = sum(u.layout.numel for u in w.units)
        out["persistent"] = sum(u.persistent_numel for u in w.units)  # kept whole, gradients all-reduced
    return out


def formula(variant, padded, N, k, elem_bytes, weight_block_numel=2048, grad_block_numel=512, persistent_numel=0):
    """Per-node bytes per step under the ring model, {collective: [intra, cross]}, collective in
    forward_all_gather / backward_all_gather / gradients; `padded` = each unit's N*s elements.
    Derived from the algorithms (zeropp.bytes_per_rank, the planner's source too), not from comm.stats:
    a node's k ranks send k times one rank's bytes, of which, on a ring over several nodes, one
    rank's share of each ring collective crosses to the next node."""
    flags = VARIANTS[variant] or dict(quantized_weights=False, hpz=False, quantized_gradients=False)
    rank = bytes_per_rank(padded, N, k, elem_bytes, weight_block_numel=weight_block_numel,
                          grad_block_numel=grad_block_numel, persistent_numel=persistent_numel, **flags)
    cross_ring = N // k > 1
    return {c: [k * b["ring"] - (b["ring"] if cross_ring else 0.0) + k * b["node"],
                (b["ring"] if cross_ring else 0.0) + k * b["across"]] for c, b in rank.items()}


def cross_messages(variant, units, N, k):
    """Messages per step on one node's cross-node link (the alpha term of lesson 01's model): a ring
    collective over all N ranks is N-1 steps, each one chunk across (qwZ sends codes and scales as
    one message); qgZ's hop 2 is nodes-1 messages from each of the node's k ranks."""
    flags, nodes = VARIANTS[variant] or {}, N // k
    if nodes == 1:
        return 0
    per_unit = (N - 1) * (1 if flags.get("hpz") and k > 1 else 2)
    per_unit += k * (nodes - 1) if flags.get("quantized_gradients") else N - 1
    return units * per_unit


def measured_per_node(per_rank, variant, k):
    """The same split from traffic()'s results: summed over each node's ranks, {collective: [intra,
    cross] per node} (max over nodes: they are equal by symmetry, and a test checks it)."""
    nodes = {}
    for rank, res in enumerate(per_rank):
        v = res["variants"][variant]
        row = nodes.setdefault(rank // k, {"forward_all_gather": [0.0, 0.0], "backward_all_gather": [0.0, 0.0],
                                           "gradients": [0.0, 0.0]})
        for op, (intra, cross) in v["forward"].items():
            row["forward_all_gather"][0] += intra
            row["forward_all_gather"][1] += cross
        for op, (intra, cross) in v["backward"].items():
            key = "backward_all_gather" if op == "all_gather" else "gradients"
            row[key][0] += intra
            row[key][1] += cross
    return list(nodes.values())


# ----------------------------------------------------------------------------- convergence
def convergence(comm, node_size=2, steps=300, micro=4, lr=3e-3, model_kwargs=None, variants=tuple(VARIANTS),
                error_every=10, time_every=5, weight_block_numel=2048, grad_block_numel=512, wrap=None):
    """Every variant trained side by side (step k of each, then k+1: load hits all alike) with Adam,
    fp32 masters and compute. Per variant: losses (mean over ranks), step times (the slowest rank's,
    every `time_every` steps, each started after a barrier; None otherwise), and the quantization
    error (relative L2, on this rank's shards) per step: weights on every step, gradients every
    `error_every` steps (measure_error runs an exact reduce-scatter too: those steps are not timed).
    wrap=one_unit: the whole model one unit, fewer collectives per step (on 2 oversubscribed cores
    each costs a scheduler slice)."""
    torch.set_num_threads(1)
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # the first Adam imports torch._dynamo: now
    mesh = Mesh(comm, node_size=node_size)
    cfg = {**LESSON_GPT, **(model_kwargs or {})}
    runs = {}
    for name in variants:
        net = build_model("tiny-gpt", seed=0, **cfg)
        w = build(name, net, mesh, wrap=wrap, weight_block_numel=weight_block_numel, grad_block_numel=grad_block_numel)
        runs[name] = (w, torch.optim.Adam(w.parameters(), lr=lr))
    batches = global_batches(net, steps, micro * comm.size)
    res = {name: {"loss": [], "time": [], "weight_error": [], "grad_error": []} for name in variants}
    for step, batch in enumerate(batches):
        x, y = shard(batch, comm.rank, comm.size)
        for name, (w, opt) in runs.items():
            probe = isinstance(w, ZeroPP) and w.quantized_gradients and step % error_every == 0
            if isinstance(w, ZeroPP):
                w.measure_error = probe
            timed = step % time_every == time_every - 1
            if timed:
                comm.barrier()
            t0 = time.perf_counter()
            loss = w(x, y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            r = res[name]
            r["time"].append(time.perf_counter() - t0 if timed and not probe else None)
            r["loss"].append(loss.item())
            err = w.quantization_error() if isinstance(w, ZeroPP) else {}
            r["weight_error"].append(err.get("weights", None) and err["weights"][0])
            if probe:
                r["grad_error"].append((step, err["gradients"][0]))
    # the global loss is the mean over ranks; a step takes as long as its slowest rank
    everyone = comm.allgather_object({n: (r["loss"], r["time"]) for n, r in res.items()})
    for name, r in res.items():
        r["loss"] = [sum(v) / comm.size for v in zip(*(e[name][0] for e in everyone))]
        r["time"] = [None if t[0] is None else max(t) for t in zip(*(e[name][1] for e in everyone))]
    return res


def error_samples(comm, node_size=2, block_numel=(2048, 512), steps=5, count=4000):
    """What quantization does to real tensors: |x - x'| / scale for a trained block's weights (int8)
    and its full gradient (int4), `count` of each (rank 0's; the bound is 1/2)."""
    from minizero.zero.quantize import dequantize_blockwise, quantize_blockwise
    net = build_model("tiny-gpt", seed=0, **LESSON_GPT)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for batch in global_batches(net, steps, 16):
        net(*batch)[1].backward()
        grads = torch.cat([p.grad.reshape(-1) for p in net.h[0].parameters()])  # the last step's are kept
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = torch.cat([p.detach().reshape(-1) for p in net.h[0].parameters()])
    out = {}
    for kind, x, bits, block in (("weights int8", weights, 8, block_numel[0]),
                                 ("gradients int4", grads, 4, block_numel[1])):
        codes, scales = quantize_blockwise(x, block, bits)
        err = (x - dequantize_blockwise(codes, scales, block)[0]).abs()
        scale = scales[0].repeat_interleave(block)[:x.numel()]
        ratio = err[scale > 0] / scale[scale > 0]
        out[kind] = {"ratio": ratio[torch.linspace(0, ratio.numel() - 1, count).long()].tolist(),
                     "max_ratio": float(ratio.max()), "rel_l2": float(err.norm() / x.norm())}
    return out


def lesson(comm, steps=40):
    """Lesson 08, one 4-rank job (2 nodes x 2): fp16 traffic (a unit per block), fp32 traffic and
    `steps` of convergence (the model as one unit), error samples, and a ping-pong for this
    machine's alpha and beta (experiments/collectives.py)."""
    from minizero_course.experiments.collectives import pingpong
    t0 = time.perf_counter()
    out = {"traffic": {"fp16": traffic(comm, 2, "fp16", model_kwargs=LESSON_GPT, steps=1),  # a unit per block
                       "fp32": traffic(comm, 2, "fp32", model_kwargs=LESSON_GPT, steps=1, wrap=one_unit)}}  # as timed
    out["timing"] = [("traffic", time.perf_counter() - t0)]
    # +hpZ trains bitwise like ZeRO-3 (it moves the same values; tests/test_zeropp.py asserts it): not rerun here
    out["convergence"] = convergence(comm, 2, steps, variants=("ZeRO-3", "+qwZ", "+qgZ", "ZeRO++"), wrap=one_unit)
    out["timing"].append(("convergence", time.perf_counter() - t0))
    out["errors"] = error_samples(comm)  # on every rank (cheap): none spins in a barrier meanwhile
    out["pingpong"] = pingpong(comm, sizes_bytes=(8, 2 ** 12, 2 ** 16, 2 ** 20), repeats=10)["rows"]
    out["timing"].append(("errors, ping-pong", time.perf_counter() - t0))
    return out


def describe_break_even(step_ratio: float, extra: float, saved: float, zero3_step: float, msgs: int,
                        msgs_zero3: int, noise: float = 0.05) -> str:
    """Lesson 08's break-even bandwidth from the run. extra: ZeRO++'s step minus ZeRO-3's (seconds,
    each with its cross-node messages' alpha); saved: the bytes it saves across each node per step.
    A step difference within `noise` of ZeRO-3's step is no measured extra time: no break-even."""
    if abs(step_ratio - 1) <= noise:
        band = noise * zero3_step
        diff_ms = (step_ratio - 1) * zero3_step * 1e3
        return (f"The two measured steps differ by less than {noise:.0%} ({diff_ms:+.1f} ms), "
                "which this section calls noise, so this run does not measure ZeRO++'s extra "
                "time and gives no break-even bandwidth. It only bounds it: an extra time "
                f"inside the noise band ({band * 1e3:.1f} ms) would put the break-even at "
                f"{saved / 1e3:.1f} KB / "
                f"{band * 1e3:.1f} ms = {saved / band / 1e6:.2f} MB/s or above.")
    if extra <= 0:
        return (f"Counting each cross-node message's α ({msgs} messages against ZeRO-3's "
                f"{msgs_zero3}), ZeRO++'s step was shorter than ZeRO-3's by more than the "
                f"noise before any byte is sent ({extra * 1e3:+.1f} ms), so there is no extra "
                "time to pay back: on this machine the model has it pay at any bandwidth.")
    return (f"Its break-even bandwidth, saved bytes / extra seconds = {saved / 1e3:.1f} KB / "
            f"{extra * 1e3:.1f} ms = **{saved / extra / 1e6:.2f} MB/s**: below that, the "
            "quantization this CPU does costs less than the bytes it saves.")
