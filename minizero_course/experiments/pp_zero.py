"""PP + ZeRO-2/3, measured: what lesson 09 (section 9), lesson 11 and tests/test_pp_zero.py launch.

    measure(comm, modes=MODES, m=4, steps=4)    dp 2 x pp 2 (4 ranks), 1F1B, TinyGPT with a tied embedding

The data-parallel half of each pipeline stage, five ways (SGD with momentum, the same batches):
    zero1          ShardedOptimizer: full gradients accumulate over the m micro-batches, one reduce-scatter
    zero2-once     ShardGradOp, every backward but the step's last inside no_sync(): full gradients
                   accumulate (ZeRO-1's memory), one reduction per step
    zero2-every    ShardGradOp reducing inside every micro-batch's backward (DeepSpeed's stage 2 with
                   gradient accumulation): m reductions, only the gradient shard outlives a backward
    zero3-every    FSDP of the stage over mesh.dp: every micro-batch all-gathers the weights in forward and
                   again in backward, and reduce-scatters its gradient (m x the 3 collectives)
(minizero's FSDP has no no_sync: a "zero3-once" would keep the full gradients and, in DeepSpeed and
FSDP2, also the gathered weights; it is left out, not estimated.)

Per mode it measures, on every rank: the step time (median of the timed steps, a barrier before each),
the bytes each collective sent in one step (comm.stats, where they are sent), the ledger's model states
(parameters + gradients + optimizer state) sampled after every pipeline action of one step, their peak,
and the largest parameter difference from one process trained on the whole batch.

The tied embedding. TinyGPT's lm_head.weight is wte.weight: stage 0 holds it as the embedding, stage 1 as
the head. PipelineStage.reduce_tied_gradients sums the two copies' FULL gradients after the backward; once
ZeRO-2/3 has reduced a gradient into dp shards and freed the full one, there is nothing left to sum (and
the two stages' shards cover different element ranges of it). `tie="shards"` (the default) sums the
reduced shards instead (PipelineStage.reduce_tied_shards: one all-reduce of the tied tensor over dp to
rebuild it, one over the tied pair), `tie="none"` skips it: the lost gradient the lesson shows.
"""
from __future__ import annotations

import statistics
import time

import torch

MODES = ("zero1", "zero2-once", "zero2-every", "zero3-every")
GPT = {"vocab_size": 256, "block_size": 32, "n_head": 4, "n_embd": 64, "n_layer": 4, "tie_weights": True}


def _owned_tied(mode, stage, wrapped, dp_rank):
    """[(q, lo, view)] per tied parameter q: the reduced gradient of q's flattened elements
    [lo, lo + view.numel()) that this rank holds (PipelineStage.reduce_tied_shards)."""
    if mode.startswith("zero2"):
        layout, shard = wrapped.layout, wrapped.grad_shard
        start, end = dp_rank * layout.shard_numel, (dp_rank + 1) * layout.shard_numel
        index = {id(q): i for i, q in enumerate(wrapped.params)}
        out = []
        for q in stage.tied:
            a = layout.offsets[index[id(q)]]
            lo, hi = max(a, start), min(a + q.numel(), end)
            out.append((q, max(lo - a, 0), shard[lo - start:hi - start] if lo < hi else shard[:0]))
        return out
    out = []  # zero3: FSDP's local part IS the original Parameter (1-D, the elements this rank owns)
    for fsdp in wrapped:
        for unit in fsdp.units:
            for (j, _, numel, lo), p in zip(unit.slots["shard"], unit.visible):
                if any(p is q for q in stage.tied):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    out.append((p, lo, p.grad))
    return out


def _build(mesh, mode, cfg, lr, seed, micro):
    from minizero.models import TinyGPT
    from minizero.pipeline import PipelineStage
    full = TinyGPT(cfg, seed=seed)
    names = {id(q): n for n, q in full.named_parameters()}
    shapes = {n: tuple(q.shape) for n, q in full.named_parameters()}
    stage = PipelineStage(full.pipeline_parts(), mesh, (micro, cfg.block_size, cfg.n_embd))
    sgd = {"lr": lr, "momentum": 0.9}
    if mode == "zero1":
        from minizero.zero import ShardedOptimizer
        opt = ShardedOptimizer(list(stage.parameters()), torch.optim.SGD, mesh.dp, **sgd)
        return stage, opt, None, opt, names, shapes
    if mode.startswith("zero2"):
        from minizero.zero import ShardGradOp
        wrapped = ShardGradOp(stage, torch.optim.SGD, mesh.dp, **sgd)
        return stage, wrapped, wrapped if mode == "zero2-once" else None, wrapped, names, shapes
    from minizero.zero.fsdp import FSDP
    from minizero.zero.fsdp_optimizer import FSDPOptimizer
    fsdps = []
    for c in range(len(stage.chunks)):  # the runtime calls each chunk: FSDP's forward (and its hooks) run there
        fsdps.append(FSDP(stage.chunks[c], mesh.dp))
        stage.chunks[c] = fsdps[-1]
    opts = [FSDPOptimizer(f, torch.optim.SGD, **sgd) for f in fsdps]
    return stage, _Both(opts), None, fsdps, names, shapes


class _Both:
    """Several FSDP units' optimizers stepped as one (a stage of v chunks)."""

    def __init__(self, opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()


def _ledger_objects(mode, stage, opt, wrapped):
    if mode == "zero1":
        return (opt,)
    if mode.startswith("zero2"):
        return (wrapped,)
    return (*opt.opts, *wrapped)


def _states(ledger) -> int:
    c = ledger.by_category
    return c["parameters"] + c["gradients"] + c["optimizer_state"] + c.get("master_params", 0)


def run_mode(comm, mesh, mode, batches, reference, m=4, lr=0.05, seed=0, tie="shards"):
    """One mode: len(batches) steps (the first warms up, the second is measured, the rest are timed)."""
    from minizero import memory
    from minizero.data import shard
    from minizero.models import GPTConfig
    from minizero.pipeline import PipelineRuntime, make_schedule
    cfg = GPTConfig(**GPT)
    stage, opt, data_parallel, wrapped, names, shapes = _build(mesh, mode, cfg, lr, seed,
                                                               batches[0][0].shape[0] // (m * mesh.dp_size))
    tie_comm = stage.tie_comm
    sharded_tie = mode != "zero1"
    if sharded_tie:
        stage.tie_comm = None  # the runtime's full-gradient sum would add zeros (zero2) or mismatched shards (zero3)
    pipe = PipelineRuntime(stage, make_schedule("1f1b", mesh.pp_size, m), data_parallel=data_parallel)
    objects = _ledger_objects(mode, stage, opt, wrapped)
    samples = []
    original = {k: getattr(pipe, k) for k in ("_forward", "_backward")}

    def sampled(kind):
        def run(k, c):
            t = original[kind](k, c)
            samples.append(_states(memory.measure(*objects)))
            return t
        return run
    out = {"mode": mode, "tie": tie if sharded_tie else "full gradients", "rank": comm.rank, "pp_rank": mesh.pp_rank,
           "dp_rank": mesh.dp_rank, "m": m,
           "dp": mesh.dp_size, "pp": mesh.pp_size, "numel": sum(q.numel() for q in stage.parameters()),
           "tied_numel": sum(q.numel() for q in stage.tied),
           "step_s": [], "sent_by_op": None, "losses": []}
    for step, (x, y) in enumerate(batches):
        x, y = shard((x, y), mesh.dp_rank, mesh.dp_size)
        if step == 1:  # step 0 warms up (and creates the optimizer state), step 1 samples the ledger after
            # every action and counts the bytes, the others are timed
            pipe._forward, pipe._backward = sampled("_forward"), sampled("_backward")
        comm.barrier()
        comm.stats.reset()
        t0 = time.perf_counter()
        loss = pipe.step(x, y)
        if sharded_tie and tie == "shards" and tie_comm is not None:
            stage.reduce_tied_shards(_owned_tied(mode, stage, wrapped, mesh.dp_rank), mesh.dp, tie_comm)
        if step == 1:
            samples.append(_states(memory.measure(*objects)))
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - t0
        if step == 1:
            pipe._forward, pipe._backward = original["_forward"], original["_backward"]
            out["sent_by_op"] = {op: s["sent_bytes"] for op, s in comm.stats.as_dict().items() if op != "barrier"}
            out["states_peak"] = max(samples)
            out["states_after_step"] = _states(memory.measure(*objects))
        elif step > 1:
            out["step_s"].append(elapsed)
        out["losses"].append(None if loss is None else loss.item())
    out["step_median_s"] = statistics.median(out["step_s"])
    out["max_diff"] = _distance(mode, reference, stage, wrapped, names, shapes)
    return out


def _reference(cfg, seed, batches, lr) -> dict:
    """One process trained on the whole batches: {name: parameter}."""
    from minizero_course.experiments.references import make_optimizer
    from minizero.models import TinyGPT
    model = TinyGPT(cfg, seed=seed)
    opt = make_optimizer("sgd", model.parameters(), lr)
    for x, y in batches:
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: q.detach() for n, q in model.named_parameters()}


def _distance(mode, ref, stage, wrapped, names, shapes):
    """Largest |parameter - one process's| over this rank's stage, after the same steps."""
    if mode.startswith("zero3"):
        got = {}
        for fsdp in wrapped:
            ids = {n: id(p) for n, p in fsdp.named_parameters()}
            for n, t in fsdp.gather_full_params().items():
                if n in ids and ids[n] in names:
                    got[names[ids[n]]] = t
    else:
        got = {names[id(q)]: q.detach() for q in stage.parameters()}
    return max((got[n].reshape(shapes[n]) - ref[n]).abs().max().item() for n in got)


def measure(comm, modes=MODES, m=4, steps=4, micro=2, lr=0.05, seed=0, data_seed=1, lost=(), mesh=None):
    """Every mode in `modes` on dp 2 x pp 2 of comm's 4 ranks, steps + 2 steps each (a warm-up, the
    measured one, `steps` timed), the tied gradient summed over its shards; then each mode in `lost`
    again without that sum (tie="none": the lost gradient). -> [one dict per run] on this rank."""
    from minizero.comm import Mesh
    from minizero_course.experiments.references import global_batches
    from minizero.models import GPTConfig, TinyGPT
    mesh = mesh or Mesh(comm, pp=2)
    cfg = GPTConfig(**GPT)
    batches = global_batches(TinyGPT(cfg, seed=seed), steps + 2, micro * m * mesh.dp_size, seed=data_seed)
    reference = _reference(cfg, seed, batches, lr)
    runs = [run_mode(comm, mesh, mode, batches, reference, m=m, lr=lr, seed=seed) for mode in modes]
    for mode in lost:
        runs.append(run_mode(comm, mesh, mode, batches, reference, m=m, lr=lr, seed=seed, tie="none"))
    return runs
