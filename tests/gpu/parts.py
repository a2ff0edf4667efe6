"""The parts of `make test-gpu` (tests/gpu/check.py): each runs on every rank of a launch and returns the
same table rows on every rank: {check, expected, measured, pass}.

Each part compares a mechanism's solution (the package: labs/ and solutions/ are generated from it) with
its ground truth, on `comm.device` (its GPU, or the CPU), reusing the code that already measures it:
  ring          lab 01's comparison with the backend's all-reduce, and its byte count
  strategies    `minizero demo`'s worker: DDP, ZeRO-1/2/3 against one process; the ledger against the estimator
  loss_scaling  lesson 03's training loop: fp16 + the loss scaler against fp32; one rank's inf skips the step
  offload, zeropp, pipeline, tensor, context, experts: the engine (DeepSpeed's config) against one process
                (offload: against the same stage without it; ZeRO++: against ZeRO-3), model states against
                the planner (minizero.planner: memory.estimate_by_location composed with TP/PP/CP/EP)
  world_of_one  torch.distributed at a world of one (NCCL on CUDA, gloo on CPU)
  tensor_cores  fp16/bf16 matmuls against fp64 (on CUDA: and faster than fp32)
  offload_one   ZeRO-Offload at a world of one: ledger by location, bytes moved each way, the CUDA peak
  quantizer     ZeRO++'s block-wise quantizer on the device: the error bound, codes equal to the CPU's
On CUDA every memory row also reads torch.cuda.max_memory_allocated of each rank (its own process)."""
from __future__ import annotations

import gc
import json
import os
import threading
import time

import torch

from minizero.data import shard
from minizero_course.experiments.references import global_batches, train_single
from minizero.models import GPTConfig, TinyGPT


def row(check: str, expected: str, measured: str, ok: bool) -> dict:
    return {"check": check, "expected": expected, "measured": measured, "pass": bool(ok)}


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3f} MB"


def _cuda(comm) -> bool:
    return comm.device.type == "cuda"


def _peak(comm):
    """torch.cuda.max_memory_allocated of this rank's process since the part began (None on CPU)."""
    return torch.cuda.max_memory_allocated(comm.device) if _cuda(comm) else None


# ----------------------------------------------------------------------------- sizes
def gpt(quick: bool, **extra) -> dict:
    """TinyGPT's shape: tiny on CPU (--quick), a few MB of states per rank on a GPU."""
    base = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32) if quick else \
        dict(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=256)
    return {**base, **extra}


def steps_of(quick: bool) -> int:
    return 3 if quick else 5


SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


# ----------------------------------------------------------------------------- the engine against one process
def one_process(shape: dict, batches, device, dtype=torch.float32) -> list[float]:
    """The ground truth: one process, the full global batch, SGD with momentum as the engine's."""
    model = TinyGPT(GPTConfig(**shape), seed=0).to(device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=SGD["params"]["lr"], momentum=SGD["params"]["momentum"])
    return train_single(model, opt, [(x.to(device), y.to(device)) for x, y in batches])


def engine_run(comm, config: dict, shape: dict, steps: int, rows_per_rank: int = 2, micro: int | None = None):
    """Train TinyGPT through minizero.initialize's engine for `steps` steps on comm.device: the global-batch
    loss of each step, this rank's ledger after the last backward, the engine, the global batches."""
    from minizero.runtime.engine import build_engine
    model = TinyGPT(GPTConfig(**shape), seed=0)
    engine = build_engine(model, config, comm)
    batches = global_batches(model, steps, rows_per_rank * engine.dp_size)
    losses, ledger = [], None
    for step, (x, y) in enumerate(batches):
        if micro is not None:  # a pipeline: the whole batch, cut into micro-batches by the engine
            losses.append(engine.train_batch(iter(zip(x.split(micro), y.split(micro)))).item())
            if step == steps - 1:
                ledger = engine.memory()
            continue
        xs, ys = (t.to(engine.device) for t in shard((x, y), engine.dp_rank, engine.dp_size))
        loss = engine(xs, ys)
        engine.backward(loss)
        if step == steps - 1:  # gradients and optimizer state both alive
            ledger = engine.memory()
        engine.step()
        total = loss.detach().float().reshape(1).clone()
        engine.dp_comm.all_reduce(total, op="avg")  # the mean over the global batch (tp ranks share rows)
        losses.append(total.item())
    return losses, ledger, engine, batches


def _gap(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def loss_row(comm, name, losses, reference, tol, against="one process") -> dict:
    gap = max(comm.allgather_object(_gap(losses, reference)))
    return row(f"{name}: losses = {against}", f"max |diff| <= {tol:.0e} over {len(losses)} steps",
               f"{gap:.1e}", gap <= tol and len(losses) == len(reference))


def planned_memory(shape: dict, comm_size: int, **strategy):
    """The planner's model states for this configuration (fp32, SGD with momentum, as the engine runs)."""
    from minizero.planner import ModelShape, ParallelStrategy, plan
    g = GPTConfig(**shape)
    s = ModelShape(g.n_layer, g.n_embd, g.n_head, g.block_size, g.vocab_size, g.tie_weights, g.num_experts, g.moe_top_k,
                   g.moe_capacity_factor)
    return plan(s, ParallelStrategy(comm_size, precision="fp32", optimizer="sgd", **strategy))


CATS = ("parameters", "master_params", "gradients", "optimizer_state")


def memory_row(comm, name, ledger, stage_plan, shape, cats=CATS) -> dict:
    """This rank's ledger (model states by category, device and host) against the planner's, up to the
    padding of the flat shards (a few elements per flat buffer and per ZeRO-3 unit); on CUDA, the rank's
    peak allocation must hold at least the ledger's device bytes."""
    pad = (shape["n_layer"] + 2) * comm.size * 4
    worst, device, host = 0, 0, 0
    bad = []
    for where, planned in (("device", stage_plan.memory), ("host", stage_plan.host)):
        for c in cats:
            got, want = ledger.detail[c][where], planned.get(c, 0)
            device += got if where == "device" else 0
            host += got if where == "host" else 0
            if not 0 <= got - want <= pad:
                bad.append(f"{c}@{where} {got} vs {want:.0f}")
            worst = max(worst, abs(got - want))
    peak = _peak(comm)
    per_rank = comm.allgather_object((device, host, worst, bad, peak))
    ok = all(not b for _, _, _, b, _ in per_rank) and all(p is None or p >= d for d, _, _, _, p in per_rank)
    dev = [d for d, *_ in per_rank]
    measured = f"ledger device {_mb(min(dev))}..{_mb(max(dev))}, host {_mb(max(h for _, h, *_ in per_rank))}" + \
        (f", CUDA peak {_mb(min(p for *_, p in per_rank))}..{_mb(max(p for *_, p in per_rank))}" if peak is not None
         else "")
    first_bad = next((f"rank {r}: {b[0]}" for r, (*_, b, _) in enumerate(per_rank) if b), "")
    expected = (f"planner per category, +0..{pad} B padding" + ("" if cats == CATS else f" ({', '.join(cats)})")
                + ("; CUDA peak >= ledger device" if peak is not None else ""))
    return row(f"{name}: model states = planner", expected, measured + (f" [{first_bad}]" if first_bad else ""), ok)


# ----------------------------------------------------------------------------- the parts
def ring(comm, quick, corrupt=False):
    """Lab 01: the ring all-reduce from isend/recv equals the backend's all-reduce, and sends 2(N-1)/N*S."""
    from minizero_course.grader import lab01
    from minizero.comm import ring_bytes_sent
    from minizero.comm.ring import ring_all_reduce
    from minizero_course.experiments.timed_comm import TimedComm

    def ring_fn(c, t):
        ring_all_reduce(c, t)
        if corrupt and c.rank == c.size - 1:  # the self-test: one element off by 1e-3 must fail the row
            t.view(-1)[0] += 1e-3
    worst = lab01._compare(comm, ring_fn, TimedComm(comm, lambda: 0))
    if isinstance(worst, dict):
        raise RuntimeError(f"ring_all_reduce left {worst['never_waited']} in flight")
    all_worst = comm.allgather_object([(d, ok) for d, _, _, ok, *_ in worst])
    diff = max(d for w in all_worst for d, _ in w)
    rows = [row(("self-test, one element off: " if corrupt else "") +
                f"ring all-reduce = backend all-reduce (N={comm.size}, sizes {lab01.SIZES}, fp32/fp64)",
                "rel. diff <= 1e-5 (fp32), 1e-12 (fp64)", f"max |diff| {diff:.1e}",
                all(ok for w in all_worst for _, ok in w))]
    if corrupt:
        return rows
    n = 1 << (12 if quick else 22)
    got = lab01.bytes_worker(comm, "minizero.comm.ring", n)
    sent = comm.allgather_object((got["sent"], got["ok"]))
    want = ring_bytes_sent("all_reduce", n * 4, comm.size)
    rows.append(row(f"ring all-reduce: bytes sent per rank (S = {_mb(n * 4)})", f"2(N-1)/N*S = {want:.0f} B",
                    " ".join(f"{s:.0f}" for s, _ in sent), all(abs(s - want) <= 1e-9 * want and ok for s, ok in sent)))
    return rows


def strategies(comm, quick):
    """`minizero demo`'s worker: DDP (bucketed, overlapped), ZeRO-1, -2, -3 on the same data; losses against
    one process; model states against memory.estimate; what each rank holds ordered DDP > ZeRO-1 > ZeRO-2 > ZeRO-3."""
    from minizero.cli.demo import train_worker
    res = comm.allgather_object(train_worker(comm, steps=steps_of(quick), global_batch=4 * comm.size, progress=False))
    ref = res[0]["single_process_losses"]
    rows, held = [], {}
    for i, run0 in enumerate(res[0]["runs"]):
        name, runs = run0["strategy"], [r["runs"][i] for r in res]
        gap = max(_gap(r["losses"], ref) for r in runs)
        tol = 1e-4 if _cuda(comm) else 1e-5
        rows.append(row(f"{name}: losses = one process (TinyGPT, Adam)", f"max |diff| <= {tol:.0e}", f"{gap:.1e}",
                        gap <= tol))
        # the estimator is the ZeRO paper's ideal: the ledger adds the padding to N and Adam's step counters
        slack = 3 * 4 * (comm.size - 1) * (run0["n_param_tensors"] + 2) + 8 * run0["n_param_tensors"]
        over = [r["ledger"]["total"] - sum(r["estimate"].values()) for r in runs]
        peak = [r["ledger"]["cuda_max_allocated"] for r in runs]
        live = [r["ledger"]["cuda_allocated"] - r["cuda_base"] for r in runs] if _cuda(comm) else [None]
        # ordered by what the strategy's rank holds after the step, above what the process held before its model
        # existed: at this size the step's peak is cuBLAS's workspaces and activations (about 70 MB on an H200,
        # against 0.4-1.8 MB of states), the same for all four
        held[name] = max(live) if live[0] is not None else max(r["ledger"]["total"] for r in runs)
        est = sum(run0["estimate"].values())
        measured = ("ledger "
                    f"{_mb(min(r['ledger']['total'] for r in runs))}..{_mb(max(r['ledger']['total'] for r in runs))}")
        ok = all(0 <= o <= slack for o in over)
        if peak[0] is not None:
            measured += (f", CUDA allocated above baseline {_mb(min(live))}..{_mb(max(live))}, peak "
                         f"{_mb(min(peak))}..{_mb(max(peak))}")
            ok = ok and all(p >= a >= r["ledger"]["by_location"]["device"] for p, a, r in zip(peak, live, runs))
        rows.append(row(f"{name}: model states = estimator (memory.estimate)", f"{_mb(est)} +0..{slack} B" +
                        ("; CUDA peak >= allocated >= ledger device" if peak[0] is not None else ""), measured, ok))
    order = [held[n] for n in ("ddp", "zero1", "zero2", "zero3")]
    what = "CUDA allocated after the step - before the model" if _cuda(comm) else "ledger total"
    rows.append(row(f"memory per rank ordered ({what}, max over ranks)", "ddp > zero1 > zero2 > zero3",
                    " > ".join(_mb(p) for p in order), all(a > b for a, b in zip(order, order[1:]))))
    return rows


def loss_scaling(comm, quick):
    """Lab 03 / lesson 03's loop (experiments.mixed_precision.train): fp16 with the loss scaler tracks fp32
    (within one fp16 unit roundoff of the loss), and an inf in one rank's gradient skips that step on every
    rank and halves the scale."""
    from minizero_course.experiments.mixed_precision import loss_tolerance, train
    steps, bad = (5, 2) if quick else (12, 5)
    fp32 = train(comm, "fp32", steps=steps, batch_size=2 * comm.size)
    fp16 = train(comm, "fp16", steps=steps, batch_size=2 * comm.size, fp16={"initial_scale_power": 8})
    worst = max(abs(a - b) / loss_tolerance("fp16", a) for a, b in zip(fp32["loss"], fp16["loss"]))
    worst = max(comm.allgather_object(worst))
    rows = [row("loss scaling: fp16 + LossScaler tracks fp32", "|diff| <= 1 fp16 roundoff (u = 4.9e-4) x loss",
                f"{worst:.2f} u at worst, {sum(fp16['skipped'])} steps skipped", worst <= 1.0)]
    inj = train(comm, "fp16", steps=steps, batch_size=2 * comm.size, fp16={"initial_scale_power": 8, "hysteresis": 1},
                inject=[[comm.size - 1, bad]])
    per_rank = comm.allgather_object((inj["skipped"], inj["scale"]))
    ok = not fp16["skipped"][bad] and all(sk[bad] and sk == per_rank[0][0] and sc[bad + 1] == sc[bad] / 2
                                          for sk, sc in per_rank)
    rows.append(row(f"loss scaling: an inf on rank {comm.size - 1} at step {bad} skips it on every rank",
                    f"skipped = step {bad} only on all {comm.size} ranks; scale halves",
                    "; ".join(f"r{r} skipped {[i for i, s in enumerate(sk) if s]}, scale {sc[bad]:g}->{sc[bad + 1]:g}"
                              for r, (sk, sc) in enumerate(per_rank)), ok))
    return rows


def _config(stage=0, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "optimizer": SGD,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def offload(comm, quick):
    """ZeRO-2 + offload_optimizer cpu: the same losses as ZeRO-2 on the device; states on the host as the
    planner says; each step moves each rank's gradient shard down and its parameter shard up, 4 B/element."""
    shape, steps = gpt(quick), steps_of(quick)
    plain, _, _, batches = engine_run(comm, _config(2), shape, steps)
    cfg = _config(2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": _cuda(comm)}
    losses, ledger, engine, _ = engine_run(comm, cfg, shape, steps)
    rows = [loss_row(comm, "offload (ZeRO-2 + cpu)", losses, plain, 1e-5, against="ZeRO-2 without offload"),
            memory_row(comm, "offload (ZeRO-2 + cpu)", ledger, planned_memory(shape, comm.size, zero=2,
                                                                               offload=True).stages[0], shape)]
    traffic = engine.offload_traffic()
    shard = sum(m.numel() for m in engine.offload.masters)
    per_rank = comm.allgather_object((traffic.get("to_host", 0), traffic.get("to_device", 0), shard))
    ok = all(down == up == 4 * n * steps for down, up, n in per_rank)
    rows.append(row(f"offload: bytes device->host and host->device per rank ({steps} steps)",
                    "4 B x shard elements x steps, each way (fp32 gradients down, parameters up)",
                    "; ".join(f"{d:.0f}/{u:.0f} (shard {n})" for d, u, n in per_rank), ok))
    return rows


def zeropp(comm, quick):
    """ZeRO++ (qwZ int8 weights + hpZ in nodes of 2) trains like ZeRO-3; its states as the planner says."""
    shape, steps = gpt(quick), steps_of(quick)
    z3, _, _, _ = engine_run(comm, _config(3), shape, steps)
    cfg = _config(3)
    cfg["zero_optimization"].update(zero_quantized_weights=True, zero_hpz_partition_size=2)
    losses, ledger, _, _ = engine_run(comm, cfg, shape, steps)
    # qwZ rounds each gathered weight by up to scale/2 (1/254 of its block's largest): measured 0.01% of the loss
    # (TinyGPT 32 wide, 3 steps) to 0.13% (256 wide, 5 steps); stale or misplaced weights move it by far more
    tol = 5e-3 * max(z3)
    return [loss_row(comm, "ZeRO++ (qwZ + hpZ)", losses, z3, tol, against="ZeRO-3 (0.5% of the loss)"),
            memory_row(comm, "ZeRO++ (qwZ + hpZ)", ledger, planned_memory(shape, comm.size, zero=3, qwz=True, hpz=True,
                                                                           node_size=2).stages[0], shape)]


def pipeline(comm, quick):
    """1F1B over comm.size stages (one block each), 2 micro-batches per stage: losses against one process."""
    shape, steps, micro = gpt(quick, n_layer=comm.size), steps_of(quick), 2
    m = 2 * comm.size
    cfg = _config(0, train_batch_size=micro * m, pipeline={"stages": comm.size, "schedule": "1f1b"})
    losses, ledger, engine, batches = engine_run(comm, cfg, shape, steps, rows_per_rank=micro * m, micro=micro)
    ref = one_process(shape, batches, comm.device)
    stage = planned_memory(shape, comm.size, pp=comm.size, micro_batch=micro, micro_batches=m)
    return [loss_row(comm, f"1F1B (pp={comm.size}, m={m})", losses, ref, 1e-4 if _cuda(comm) else 1e-5),
            # read after train_batch, which frees the gradients: the other model states
            memory_row(comm, f"1F1B (pp={comm.size})", ledger, stage.stages[engine.mesh.pp_rank], shape,
                       cats=("parameters", "master_params", "optimizer_state"))]


def tensor(comm, quick):
    """Tensor parallelism over every rank (column/row-parallel layers): losses against one process."""
    shape, steps = gpt(quick), steps_of(quick)
    cfg = _config(0, tensor_parallel={"autotp_size": comm.size})
    losses, ledger, _, batches = engine_run(comm, cfg, shape, steps)
    ref = one_process(shape, batches, comm.device)
    return [loss_row(comm, f"TP (t={comm.size})", losses, ref, 1e-4 if _cuda(comm) else 1e-5),
            memory_row(comm, f"TP (t={comm.size})", ledger, planned_memory(shape, comm.size, tp=comm.size).stages[0],
                       shape)]


def context(comm, quick):
    """Ring attention over every rank (chunks r and 2cp-1-r of each sequence): losses against one process."""
    shape, steps = gpt(quick), steps_of(quick)
    cfg = _config(1, sequence_parallel_size=comm.size, context_parallel={"attention": "ring"})
    losses, ledger, _, batches = engine_run(comm, cfg, shape, steps)
    ref = one_process(shape, batches, comm.device)
    return [loss_row(comm, f"ring attention (cp={comm.size})", losses, ref, 1e-4 if _cuda(comm) else 1e-5),
            memory_row(comm, f"ring attention (cp={comm.size}, ZeRO-1)", ledger,
                       planned_memory(shape, comm.size, cp=comm.size, zero=1).stages[0], shape)]


def experts(comm, quick):
    """MoE dispatch and combine over all-to-alls (ep=2 over dp=N, top-2, no token dropped, no aux loss, so one
    process computes the same): losses against one process."""
    shape = gpt(quick, num_experts=4, moe_ep_size=2, moe_top_k=2, moe_capacity_factor=4.0, moe_aux_loss_coef=0.0)
    steps = steps_of(quick)
    losses, ledger, _, batches = engine_run(comm, _config(1), shape, steps)
    ref = one_process(shape, batches, comm.device)
    return [loss_row(comm, "MoE dispatch (ep=2, E=4, top-2, ZeRO-1)", losses, ref, 1e-4 if _cuda(comm) else 1e-5),
            memory_row(comm, "MoE (ep=2, ZeRO-1)", ledger, planned_memory(shape, comm.size, ep=2, zero=1).stages[0],
                       shape)]


def world_of_one(comm, quick):
    """torch.distributed at a world of one (NCCL on CUDA: it refuses two ranks on one GPU, not one): the demo's
    DDP and ZeRO-3 against one process."""
    import torch.distributed as dist
    from minizero.cli.demo import train_worker
    res = train_worker(comm, strategies=("ddp", "zero3"), steps=steps_of(quick), global_batch=4, progress=False)
    backend = dist.get_backend() if dist.is_initialized() else comm.backend
    want = "nccl" if _cuda(comm) else "gloo"
    gap = max(_gap(r["losses"], res["single_process_losses"]) for r in res["runs"])
    tol = 1e-4 if _cuda(comm) else 1e-5
    return [row("world of one: torch.distributed backend", want, backend, backend == want),
            row(f"world of one ({backend}): DDP, ZeRO-3 losses = one process", f"max |diff| <= {tol:.0e}", f"{gap:.1e}",
                gap <= tol)]


def tensor_cores(comm, quick):
    """fp16 and bf16 matmuls against fp64: within the format's rounding (sqrt(k) unit roundoffs of |A||B|);
    on CUDA they must also beat fp32 (no TF32) by 2x: tensor cores, not the fp32 units."""
    n = 256 if quick else 4096
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    exact = (a.double().to(comm.device) @ b.double().to(comm.device)).cpu()  # on the GPU: seconds, not minutes
    scale = (a.double().abs().to(comm.device) @ b.double().abs().to(comm.device)).cpu()
    rows = []
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on the fp32 units: the baseline tensor cores beat

    def timed(x, y):
        x, y = x.to(comm.device), y.to(comm.device)
        (x @ y)
        if _cuda(comm):
            torch.cuda.synchronize()
        reps = 3 if quick else 20
        t0 = time.perf_counter()
        for _ in range(reps):
            out = x @ y
        if _cuda(comm):
            torch.cuda.synchronize()
        return out, (time.perf_counter() - t0) / reps
    _, t32 = timed(a, b)
    for dtype in (torch.float16, torch.bfloat16):
        out, t = timed(a.to(dtype), b.to(dtype))
        u = torch.finfo(dtype).eps / 2
        # inputs rounded to the format (2u), products summed in fp32: a few u of |A||B|
        err = ((out.double().cpu() - exact).abs() / scale).max().item() / u
        tflops = 2 * n ** 3 / t / 1e12
        speed = t32 / t
        ok = err <= 4 and (not _cuda(comm) or speed >= 2)
        rows.append(row(f"{str(dtype)[6:]} matmul ({n}x{n}) on {comm.device.type}",
                        "error <= 4u x |A||B|" + ("; >= 2x fp32's speed (tensor cores)" if _cuda(comm) else ""),
                        f"{err:.2f} u; {tflops:.1f} TFLOP/s, {speed:.1f}x fp32", ok))
    return rows


def offload_one(comm, quick):
    """ZeRO-Offload at a world of one (the paper's single-GPU case), fp16 ZeRO-2: the same losses as without;
    the ledger by location against the estimator; the bytes moved each way, 2 B/element (16-bit)."""
    from minizero import initialize, memory
    from minizero_course.experiments.mixed_precision import loss_tolerance
    shape, steps = gpt(quick), steps_of(quick)
    out = {}
    for off in (False, True):
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
               "fp16": {"enabled": True, "initial_scale_power": 8},
               "zero_optimization": {"stage": 2, **({"offload_optimizer": {"device": "cpu", "pin_memory": _cuda(comm)}}
                                                    if off else {})}}
        base = 0
        if _cuda(comm):  # the plain run's engine gone first, and its bytes not counted in this run's peak
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(comm.device)
            base = torch.cuda.memory_allocated(comm.device)
        model = TinyGPT(GPTConfig(**shape), seed=0)
        psi = sum(p.numel() for p in model.parameters())
        engine = initialize(model=model, config=cfg, comm=comm).engine
        losses = []
        for x, y in global_batches(model, steps, 2):
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[off] = {"losses": losses, "ledger": engine.memory(), "traffic": engine.offload_traffic(),
                    "peak": _peak(comm) - base if _cuda(comm) else None, "psi": psi, "skipped": engine.skipped_steps}
        del engine
    plain, off = out[False], out[True]
    est = memory.estimate(plain["psi"], 1, 2, k=12, param_bytes=2, grad_bytes=2, offload_optimizer=True)
    led = off["ledger"].by_location
    slack = 64 * 4  # Adam's step counters and the like
    # both keep fp32 masters; the device path unscales the fp16 gradients where the host path has them in fp32
    # (Adam then moves a gradient flushed to 0 in one and not the other): a few fp16 roundoffs of the loss
    # (measured 1.3 u, TinyGPT 256 wide, 5 steps, CPU)
    gap, tol = _gap(plain["losses"], off["losses"]), 4 * loss_tolerance("fp16", max(plain["losses"]))
    rows = [row("offload at a world of one (fp16 ZeRO-2): losses = without offload",
                f"max |diff| <= 4 fp16 u x loss = {tol:.1e}", f"{gap:.1e} ({off['skipped']} skipped)", gap <= tol),
            row("offload at a world of one: device / host bytes = estimator",
                f"device {_mb(est.device)}, host {_mb(est.host)} (+{slack} B)",
                f"device {_mb(led['device'])}, host {_mb(led['host'])}",
                0 <= led["device"] - est.device <= slack and 0 <= led["host"] - est.host <= slack)]
    t, n_steps = off["traffic"], steps - off["skipped"]
    want = 2 * plain["psi"]
    rows.append(row(f"offload at a world of one: bytes each way per step ({steps} steps, {off['skipped']} skipped)",
                    f"2 B x Psi = {want} down and up", f"{t.get('to_host', 0) / steps:.0f} down, "
                    f"{t.get('to_device', 0) / max(n_steps, 1):.0f} up",
                    t.get("to_host", 0) == want * steps and t.get("to_device", 0) == want * n_steps))
    if _cuda(comm):
        rows.append(row("offload at a world of one: CUDA peak below the plain run's", "offload < plain",
                        f"{_mb(off['peak'])} < {_mb(plain['peak'])}", off["peak"] < plain["peak"]))
    return rows


def quantizer(comm, quick):
    """ZeRO++'s block-wise quantizer on comm.device: |x - dq(q(x))| <= scale/2 per block at odd sizes, 8 and 4
    bits, and the same codes as on the CPU."""
    from minizero.zero.quantize import dequantize_blockwise, quantize_blockwise
    gen, worst, differ, cases = torch.Generator().manual_seed(0), -1.0, 0, 0
    for bits in (8, 4):
        for block in (1, 3, 64, 2048):
            for n in ((7, 1000) if quick else (1, 7, 511, 1000, 4097)):
                x = torch.randn(3, n, generator=gen) * torch.tensor([[1e-3], [1.0], [50.0]])
                x[1, n // 2] = 400.0
                xd = x.to(comm.device)
                codes, scales = quantize_blockwise(xd, block, bits)
                back = dequantize_blockwise(codes, scales, block)
                per = scales.repeat_interleave(block, dim=1)[:, :n]
                worst = max(worst, ((xd - back).abs() - per / 2 - xd.abs() * 2 ** -22).max().item())
                differ += int((codes.cpu() != quantize_blockwise(x, block, bits)[0]).sum())
                cases += 1
    x = torch.randn(1 << (20 if quick else 26), device=comm.device)  # throughput, int8, blocks of 2048
    rate = {}
    for op in ("quantize", "dequantize"):
        codes, scales = quantize_blockwise(x, 2048, 8)
        fn = (lambda: quantize_blockwise(x, 2048, 8)) if op == "quantize" else \
            (lambda: dequantize_blockwise(codes, scales, 2048))
        fn()
        if _cuda(comm):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        if _cuda(comm):
            torch.cuda.synchronize()
        rate[op] = x.numel() * 4 * 5 / (time.perf_counter() - t0) / 1e9
    return [row(f"ZeRO++ quantizer on {comm.device.type}: error bound ({cases} cases)", "|x - dq(q(x))| <= scale/2",
                f"worst excess {worst:.1e}; int8 on {x.numel() / 2 ** 20:.0f} Mi fp32: quantize "
                f"{rate['quantize']:.3g} GB/s, dequantize {rate['dequantize']:.3g} GB/s", worst <= 0),
            row(f"ZeRO++ quantizer on {comm.device.type}: codes = the CPU's", "0 codes differ", f"{differ}",
                differ == 0)]


def selftest_hang(comm, quick):
    """The check's own test: the last rank waits at a barrier the others never reach (must time out)."""
    if comm.rank == comm.size - 1:
        comm.barrier()
    return [row("self-test: a hung part", "timed out", "returned", False)]


def selftest_wrong(comm, quick):
    """The check's own test: a ring all-reduce one element off on one rank (its row must fail)."""
    return ring(comm, quick, corrupt=True)


WORLD = {"ring": ring, "strategies": strategies, "loss_scaling": loss_scaling, "offload": offload, "zeropp": zeropp,
         "pipeline": pipeline, "tensor": tensor, "context": context, "experts": experts}
ONE = {"world_of_one": world_of_one, "tensor_cores": tensor_cores, "offload_one": offload_one, "quantizer": quantizer}
SELFTEST = {"selftest_hang": selftest_hang, "selftest_wrong": selftest_wrong}
PARTS = {**WORLD, **ONE, **SELFTEST}


# ----------------------------------------------------------------------------- the launch target
def run_parts(comm, names, quick, out_dir, timeouts):
    """Run each part in turn; rank 0 writes its rows to out_dir/NAME.json as soon as it ends. A part that runs
    past its timeout (a hang) writes NAME.timeout, saying where this rank was, and kills this rank; an error ends
    the job too (the launcher's RankError). Either way tests/gpu/check.py reports that part as a failed row and
    relaunches the parts after it."""
    from minizero import memory
    from minizero.comm.backends import heartbeat
    torch.manual_seed(0)
    for name in names:
        def expire(name=name):
            with open(os.path.join(out_dir, f"{name}.timeout"), "a") as f:
                f.write(f"rank {comm.rank}: {heartbeat.text or 'no collective yet'}\n")
            os.kill(os.getpid(), 9)
        timer = threading.Timer(timeouts[name], expire)
        timer.daemon = True
        timer.start()
        if _cuda(comm):
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(comm.device)
        memory.transient.reset()
        t0 = time.perf_counter()
        rows = PARTS[name](comm, quick)
        seconds = max(comm.allgather_object(time.perf_counter() - t0))
        timer.cancel()
        if comm.rank == 0:
            with open(os.path.join(out_dir, f"{name}.json.tmp"), "w") as f:
                json.dump({"rows": rows, "seconds": seconds}, f)
            os.replace(os.path.join(out_dir, f"{name}.json.tmp"), os.path.join(out_dir, f"{name}.json"))
    return {"device": str(comm.device), "backend": comm.backend}
