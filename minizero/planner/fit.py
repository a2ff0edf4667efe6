"""Which strategies fit a memory budget, ranked by an estimated step time.

    hw = HARDWARE["h100-ib"]
    for p, seconds in fit(shape, world=64, budget_bytes=80e9, hardware=hw,
                          global_batch=512)[:5]: ...

The estimate (deliberately simple, every term printed by `minizero plan`):
    compute   = 6·Ψ·tokens per rank / (flops · mfu), ×4/3 with checkpointing (one more forward),
                ×(m + p - 1)/m for the pipeline bubble (GPipe and 1F1B alike)
    comm      = Σ over groups: calls·α + bytes/β of the group's link (α-β model, lesson 01)
    offload   = the gradient shard down and the parameter shard up over PCIe
                (the CPU step not counted)
    step time = compute + comm + offload (no overlap assumed: an upper bound)
Every candidate trains the same global batch: m = global_batch / (micro_batch · dp) micro-batches.
Ψ·tokens per rank = the whole model's FLOPs over the world: DP splits the batch, TP and PP the
model, CP the sequence (attention's s² term not counted); Ψ of a MoE shape is the active parameters
(k of E experts).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from minizero.planner.plan import (
    DTYPES,
    FREEZE_STEP,
    ModelShape,
    Plan,
    PlanError,
    ParallelStrategy,
    plan,
)


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float            # peak dense 16-bit FLOP/s of one GPU
    mfu: float              # fraction of it a training step reaches
    intra_bw: float         # bytes/s one rank sends over the intra-node link (NVLink)
    inter_bw: float         # bytes/s over the cross-node link (the NIC per GPU)
    intra_alpha: float      # seconds of latency per collective inside a node
    inter_alpha: float      # ... across nodes
    pcie_bw: float          # bytes/s between a GPU and its host (offload's copies)


# Datasheet figures: H100 SXM 989 TFLOP/s dense bf16, NVLink 4 at 450 GB/s per direction; A100
# 312 TFLOP/s, NVLink 3 at 300 GB/s; InfiniBand NDR 400 Gb/s = 50 GB/s per GPU, HDR 200 Gb/s = 25
# GB/s; PCIe 5 x16 about 50 GB/s per direction, PCIe 4 about 25 GB/s.
HARDWARE = {
    "h100-ib": Hardware("H100 SXM, NVLink 4, 400 Gb/s InfiniBand per GPU", 989e12, 0.4, 450e9, 50e9,
                        5e-6, 10e-6, 50e9),
    "a100-ib": Hardware("A100 SXM, NVLink 3, 200 Gb/s InfiniBand per GPU", 312e12, 0.4, 300e9, 25e9,
                        5e-6, 10e-6, 25e9),
    "a100-eth": Hardware("A100 SXM, NVLink 3, 100 Gb/s Ethernet per node (slow network)", 312e12,
                         0.4, 300e9, 12.5e9 / 8, 5e-6, 30e-6, 25e9),
}


def step_time(p: Plan, hw: Hardware) -> dict:
    """Seconds per optimizer step: {"compute", "comm", "total"} for the slowest stage."""
    s, shape = p.strategy, p.shape
    tokens = s.micro_batch * s.micro_batches * shape.seq * s.dp  # global tokens per step
    flop = 6 * shape.active_params() * tokens * (4 / 3 if s.checkpointing else 1) / s.world
    bubble = (s.micro_batches + s.pp - 1) / s.micro_batches
    compute = flop / (hw.flops * hw.mfu) * bubble
    comm = 0.0
    for stage in p.stages:
        seconds = 0.0
        for group, nbytes in stage.sent.items():
            intra = stage.link[group] == "intra-node"
            calls = _calls(group, s, shape)
            seconds += calls * (hw.intra_alpha if intra else hw.inter_alpha) + nbytes / (
                hw.intra_bw if intra else hw.inter_bw
            )
        comm = max(comm, seconds)
    offload = 0.0
    if s.offload:
        shard = max(stage.params for stage in p.stages) / s.dp
        # ZeRO-Offload moves 16-bit tensors: w·Ψ/N down, w·Ψ/N up (Ren et al. 2021)
        width = DTYPES[s.precision]
        # gradients down: stage 2/3 send each micro-batch's reduced shard during its backward
        # (minizero's ZeRO-3 in fp32: its reduce-scatter output is cast before it leaves), stage 1
        # once at the step; the updated parameters come up once per step
        down = 4 if s.zero == 3 else width
        offload = (s.micro_batches if s.zero >= 2 else 1) * shard * down + shard * width
        offload /= hw.pcie_bw
    return {"compute": compute, "comm": comm, "offload": offload, "total": compute + comm + offload}


def _calls(group, s: ParallelStrategy, shape: ModelShape) -> int:
    m = s.micro_batches
    if group == "tp":
        return m * (4 * shape.layers // s.pp + 4)
    if group == "pp":
        return 2 * m
    layers = shape.layers // s.pp
    if group == "cp":  # the ring: one send per block passed; Ulysses: 8 all-to-alls per layer
        return m * layers * (8 if s.ulysses else 3 * s.cp - 2)
    if group == "ep":
        return m * layers * (4 + 2 * s.checkpointing)
    # the last two: ZeRO++'s hops inside and across nodes
    if group in ("dp", "dp-node", "dp-across", "expert_dp"):
        return {0: 1, 1: 2, 2: m + 1, 3: 3 * m * (shape.layers // s.pp + 1)}[s.zero]
    return 1


def candidates(shape: ModelShape, world: int, node_size: int, global_batch: int, micro_batch: int,
               precision="bf16", optimizer="adam", freeze_step=FREEZE_STEP, steps=0):
    """Every layout of `world` ranks this planner knows: tp dividing the node, pp and cp (ring, or
    Ulysses where the heads allow) dividing the rest, ep dividing dp for a MoE shape, ZeRO 0-3 (0-1
    with pp), offload, checkpointing, SP with tp; m from the global batch. Invalid ones (and dp not
    dividing the global batch into micro-batches) are skipped."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    layouts = [
        (tp, pp, cp, ulysses)
        for tp in divisors
        if tp <= node_size and node_size % tp == 0
        for pp in divisors
        if pp <= shape.layers
        for cp in divisors
        if world % (tp * pp * cp) == 0 and shape.seq % (2 * cp if cp > 1 else 1) == 0
        for ulysses in ((False, True) if cp > 1 else (False,))
        # same memory, fewer bytes: where Ulysses runs,
        # this no-overlap estimate ranks the ring below it
        if not (cp > 1 and not ulysses and (shape.heads // tp) % cp == 0)
    ]
    for tp, pp, cp, ulysses in layouts:
        dp = world // (tp * pp * cp)
        if global_batch % (micro_batch * dp):
            continue
        eps = (
            [e for e in divisors if dp % e == 0 and shape.experts % e == 0]
            if shape.experts
            else [1]
        )
        for ep, zero, offload, ckpt, sp in itertools.product(eps, range(4), (False, True),
                                                             (False, True), (False, True)):
            s = ParallelStrategy(world, node_size, tp, pp, sp, zero, offload, micro_batch,
                                 global_batch // (micro_batch * dp), "1f1b", ckpt, precision,
                                 optimizer, cp=cp, ulysses=ulysses, ep=ep, freeze_step=freeze_step,
                                 steps=steps)
            try:
                yield plan(shape, s)
            except PlanError:
                continue


def fit(
    shape: ModelShape,
    world: int,
    budget_bytes: float,
    hardware: Hardware,
    global_batch: int,
    node_size=8,
    micro_batch=1,
    precision="bf16",
    optimizer="adam",
    freeze_step=FREEZE_STEP,
    steps=0,
) -> list:
    """[(plan, step_time dict)] of the layouts whose busiest rank fits `budget_bytes` on the device,
    fastest first. None fits: a PlanError saying the smallest footprint and which layout has it.
    cp > 1 layouts are listed only when no cp = 1 layout fits: CP is the lever for sequences whose
    activations do not fit otherwise, and this estimate counts neither attention's s² FLOPs nor the
    ring's overlap, so it would rank cp on bytes alone (Ulysses' all-to-alls beat TP's all-reduces
    at any s)."""
    every = list(candidates(shape, world, node_size, global_batch, micro_batch, precision,
                            optimizer, freeze_step, steps))
    if not every:
        raise PlanError(f"no layout of {world} ranks is valid for this model (heads {shape.heads}, "
                        f"layers {shape.layers}, node size {node_size}, global batch "
                        f"{global_batch}, micro-batch {micro_batch})")
    fits = [p for p in every if p.peak_device_bytes <= budget_bytes]
    if any(p.strategy.cp == 1 for p in fits):
        fits = [p for p in fits if p.strategy.cp == 1]
    fits = [(p, step_time(p, hardware)) for p in fits]
    if not fits:
        smallest = min(every, key=lambda p: p.peak_device_bytes)
        raise PlanError(f"nothing fits in {budget_bytes / 1e9:g} GB per GPU: the smallest "
                        f"footprint is {smallest.peak_device_bytes / 1e9:.3g} GB "
                        f"({smallest.strategy.name()}); add GPUs, shorten the micro-batch, or give "
                        "more memory")
    # ties: the smaller
    return sorted(fits, key=lambda pair: (round(pair[1]["total"], 9), pair[0].peak_device_bytes))
