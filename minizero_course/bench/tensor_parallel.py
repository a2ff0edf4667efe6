"""minizero TP next to torch DTensor TP: the same TinyGPT, the same gloo transport, interleaved.

    python -m minizero_course bench --tp          # t = 2 and 4 on 4 ranks; --json, --plot, --steps as the DP bench

torch's DTensor tensor parallelism is `parallelize_module` with a plan: ColwiseParallel for c_attn
and c_fc, RowwiseParallel for both c_proj, RowwiseParallel(input_layouts=Replicate()) for the
embedding (vocab-parallel) and ColwiseParallel(output_layouts=Shard(-1)) for lm_head with
`loss_parallel()` (the cross-entropy on vocabulary shards). It splits c_attn's rows contiguously,
so the DTensor copy of the model gets its c_attn rows permuted first to [q_0 k_0 v_0 | q_1 k_1 v_1 |
...]: each rank then owns whole heads, and both libraries compute the same thing (the first losses
agree to 1e-6, checked every run). minizero's own communicator runs on torch.distributed (gloo) here
too, so the transport is the same; only the TP machinery differs.

Measured per t: step time (forward, backward, Adam step) of the slowest rank, median over rounds;
the paired ratio minizero / DTensor (same round, order alternating); parameter bytes per rank
(minizero: the ledger; DTensor: the ledger of its local shards); activation bytes saved for backward
(memory.SavedTensors); collectives per step (minizero: comm.stats; DTensor: its CommDebugMode).
With t < 4 the 4 ranks form 4/t tp groups that run side by side (no data parallelism: each group
trains on the same batch).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from minizero import memory
from minizero_course.bench.common import barrier, finish, paired_ratio
from minizero.comm import Mesh, init_torch_distributed
from minizero.data import SyntheticTokens
from minizero.models import GPTConfig, TinyGPT
from minizero.tensor import TensorParallelGPT

# BENCH_GPT of the DP bench (3.2 M parameters) with 8 heads, so t = 2, 4 (and 8) split them.
BENCH_TP_GPT = dict(vocab_size=64, block_size=32, n_layer=4, n_head=8, n_embd=256)
TARGET = ("minizero-tp", "dtensor-tp", 1.00, "minizero TP no slower than torch DTensor TP")


def permute_qkv_rows(model: torch.nn.Module, tp_size: int):
    """c_attn's rows [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: a contiguous split then gives each
    rank the q, k and v of its own heads (what minizero's chunks=3 split does)."""
    with torch.no_grad():
        for block in model.h:
            for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                if p is not None:
                    q, k, v = (x.chunk(tp_size, 0) for x in p.chunk(3, 0))
                    p.copy_(torch.cat([torch.cat([q[r], k[r], v[r]]) for r in range(tp_size)]))


def dtensor_tp(model: torch.nn.Module, tp_mesh):
    """torch's own tensor parallelism on the nanoGPT module names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    permute_qkv_rows(model, tp_mesh.size())
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.h)):
        plan.update({f"h.{i}.attn.c_attn": ColwiseParallel(), f"h.{i}.attn.c_proj": RowwiseParallel(),
                     f"h.{i}.mlp.c_fc": ColwiseParallel(), f"h.{i}.mlp.c_proj": RowwiseParallel()})
    return parallelize_module(model, tp_mesh, plan)


class _LocalShards:
    """memory.measure() of a DTensor model: its parameters' local shards (and their gradients)."""

    def __init__(self, model):
        self.model = model

    def memory_tensors(self):
        for p in self.model.parameters():
            yield "parameters", getattr(p, "_local_tensor", p), None
            if p.grad is not None:
                yield "gradients", getattr(p.grad, "_local_tensor", p.grad), None


def _candidate(name, tp_comm, tp_mesh, cfg, seed, lr):
    """-> (step(x, y) -> loss, model, objects for memory.measure)."""
    from torch.distributed.tensor.parallel import loss_parallel
    model = TinyGPT(GPTConfig(**cfg), seed=seed)
    if name == "minizero-tp":
        model = TensorParallelGPT(model, tp_comm)
        context, held = None, lambda: (model,)
    else:
        model = dtensor_tp(model, tp_mesh)
        context, held = loss_parallel, lambda: (_LocalShards(model),)
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def step(x, y):
        if context is None:
            loss = model(x, y)[1]
            loss.backward()
        else:
            with context():
                loss = model(x, y)[1]
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return step, model, held


def _saved_bytes(model, x, y, dtensor):
    """Bytes autograd keeps for backward in one forward (every module of the model)."""
    from torch.distributed.tensor.parallel import loss_parallel
    with memory.SavedTensors(exclude=model) as saved:
        if dtensor:
            with loss_parallel():
                model(x, y)
        else:
            model(x, y)
    return saved.total


def worker(comm, sizes=(2, 4), steps=20, warmup=3, batch=8, lr=1e-3, seed=0, model_kwargs=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    torch.set_num_threads(1)
    init_torch_distributed(comm.device)  # DTensor needs the default group (minizero may already run on it)
    cfg = {**BENCH_TP_GPT, **(model_kwargs or {})}
    data = SyntheticTokens(cfg["vocab_size"], cfg["block_size"], seed=seed)
    batches = [data.batch(s, batch) for s in range(warmup + steps)]
    dummy = torch.nn.Parameter(torch.zeros(1))  # the first Adam step imports torch._dynamo: not in a timing
    dummy.grad = torch.ones(1)
    torch.optim.Adam([dummy]).step()
    out = {"rank": comm.rank, "world": comm.size, "backend": comm.backend, "model": cfg, "batch": batch, "t": {}}
    for t in sizes:
        mesh = Mesh(comm, tp=t)
        tp_mesh = init_device_mesh("cpu", (comm.size // t, t), mesh_dim_names=("dp", "tp"))["tp"]
        built = {n: _candidate(n, mesh.tp, tp_mesh, cfg, seed, lr) for n in ("minizero-tp", "dtensor-tp")}
        res = {n: {"times": [], "losses": []} for n in built}
        x, y = batches[0]
        for name, (step, model, held) in built.items():  # memory and collectives, before any step
            res[name]["saved_bytes"] = _saved_bytes(model, x, y, name == "dtensor-tp")
            mesh.tp.stats.reset()
            with CommDebugMode() as debug:
                res[name]["losses"].append(float(step(x, y)))  # the same weights: the same first loss
            res[name]["ledger"] = memory.measure(*held()).by_category
            res[name]["collectives"] = ({op: s["calls"] for op, s in mesh.tp.stats.as_dict().items()}
                                        if name == "minizero-tp" else
                                        {str(op).split(".")[-1]: n for op, n in debug.get_comm_counts().items()})
        for k, (x, y) in enumerate(batches):
            for name in (list(built) if k % 2 == 0 else list(built)[::-1]):
                barrier(comm)
                t0 = time.perf_counter()
                loss = built[name][0](x, y)
                elapsed = time.perf_counter() - t0
                if k >= warmup:
                    res[name]["times"].append(elapsed)
                res[name]["losses"].append(float(loss))
        out["t"][str(t)] = res
        del built
    return out


def summarize(per_rank: list) -> dict:
    """Per t and candidate: the slowest rank's step times, their median, the paired ratio."""
    r0, rows = per_rank[0], {}
    for t, res in r0["t"].items():
        row = {}
        for name in res:
            slowest = [max(ts) for ts in zip(*(r["t"][t][name]["times"] for r in per_rank))]
            row[name] = {"median_step_s": statistics.median(slowest), "step_s": slowest,
                         "ledger": [r["t"][t][name]["ledger"] for r in per_rank],
                         "saved_bytes": [r["t"][t][name]["saved_bytes"] for r in per_rank],
                         "collectives": res[name]["collectives"], "losses": res[name]["losses"]}
        med, ci = paired_ratio(row["minizero-tp"]["step_s"], row["dtensor-tp"]["step_s"])
        first = [row[n]["losses"][0] for n in row]
        rows[t] = {"candidates": row, "ratio": med, "ci95": list(ci), "first_loss_diff": max(first) - min(first)}
    return {"world": r0["world"], "backend": r0["backend"], "model": r0["model"], "batch": r0["batch"], "t": rows,
            "target": {"what": TARGET[3], "limit": TARGET[2]}}


def report(summary, out=sys.stdout):
    s = summary
    print(f"\nbench --tp: TinyGPT {s['model']}, batch {s['batch']}, fp32 Adam, {s['world']} ranks, minizero on "
          f"{s['backend']}, DTensor on gloo", file=out)
    head = (f"{'t':>2} {'candidate':<12}| {'median ms':>9} | {'params MB/rank':>14} | {'saved act. MB':>13} | "
            f"collectives per step")
    print(head + "\n" + "-" * len(head), file=out)
    for t, row in s["t"].items():
        for name, r in row["candidates"].items():
            print(f"{t:>2} {name:<12}| {r['median_step_s'] * 1e3:9.1f} | {r['ledger'][0]['parameters'] / 1e6:14.3f} | "
                  f"{r['saved_bytes'][0] / 1e6:13.3f} | {r['collectives']}", file=out)
        limit = s["target"]["limit"]
        verdict = "met" if row["ci95"][1] <= limit else "missed" if row["ci95"][0] > limit \
            else "met by the median" if row["ratio"] <= limit else "missed by the median"
        print(f"   t={t}: {s['target']['what']}: paired ratio {row['ratio']:.3f} (95% CI {row['ci95'][0]:.3f}-"
              f"{row['ci95'][1]:.3f}): {verdict}; first losses differ by {row['first_loss_diff']:.1e}", file=out)


def plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ts = list(summary["t"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (name, color) in enumerate((("minizero-tp", "tab:blue"), ("dtensor-tp", "tab:orange"))):
        a.bar([j + 0.38 * i for j in range(len(ts))], [summary["t"][t]["candidates"][name]["median_step_s"] * 1e3
                                                       for t in ts], width=0.38, color=color, label=name)
    a.set(xticks=[j + 0.19 for j in range(len(ts))], xticklabels=[f"t = {t}" for t in ts],
          ylabel="ms per step (median)",
          title="step time, same model, gloo")
    a.legend(fontsize=8)
    ratio = [summary["t"][t]["ratio"] for t in ts]
    err = [[r - summary["t"][t]["ci95"][0] for r, t in zip(ratio, ts)],
           [summary["t"][t]["ci95"][1] - r for r, t in zip(ratio, ts)]]
    b.bar([f"t = {t}" for t in ts], ratio, yerr=err, color="tab:blue", capsize=4)
    b.axhline(summary["target"]["limit"], color="tab:red", ls="--", lw=1)
    b.set(ylabel="minizero / DTensor (paired median, 95% CI)", title=summary["target"]["what"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    """`python -m minizero_course bench --tp` (minizero_course.bench.bench parses the arguments)."""
    import json
    import os
    from minizero import launch
    t0 = time.time()
    sizes = [t for t in (2, 4, 8) if t <= args.nprocs and args.nprocs % t == 0]
    print(f"bench --tp: minizero TP and DTensor TP at t = {', '.join(map(str, sizes))} on {args.nprocs} ranks, "
          f"{args.warmup + args.steps} interleaved steps each (one job; the report follows when it ends)",
          file=sys.stderr, flush=True)
    per_rank = launch.run("minizero_course.bench.tensor_parallel:worker", nprocs=args.nprocs, timeout=args.timeout,
                          backend=args.backend or "torch",
                          args={"sizes": sizes, "steps": args.steps, "warmup": args.warmup, "batch": args.micro,
                                "model_kwargs": json.loads(args.model) if args.model else None})
    summary = summarize(per_rank)
    summary["load_average"] = os.getloadavg()
    return finish(args, summary, per_rank, report, plot, t0)
