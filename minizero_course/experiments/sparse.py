"""Sparse attention, measured: what docs/sparse.md's figures, lesson 15 and lab 14 come from.

One attention layer, one process, fp32 on CPU (the same code runs on CUDA). Three dense baselines:
"dense", the naive causal attention that computes and keeps all n x n scores (TinyGPT's); "causal",
the block-sparse code with every block on or below the diagonal kept (dense causal attention that
skips the upper blocks: what is left of a saving against it is sparsity, not causality); "sdpa",
torch's scaled_dot_product_attention (FlashAttention-style on this CPU: it keeps the output and the
log-sum-exp, never the scores). Measured:
  * `scaling`: per sequence length, the score bytes autograd keeps (memory.SavedTensors) and the
    forward matmul FLOPs (torch's FlopCounterMode) of dense and block-sparse attention, next to the
    formulas in minizero/sparse/attention.py;
  * `longest_under_cap`: the longest sequence whose measured saved bytes (everything attention keeps
    for backward: q, k, v or their gathered blocks, the probabilities) fit under a cap;
  * `step_seconds`: forward + backward wall time, the median of a few runs.
`python -m minizero_course.experiments.sparse` prints all three.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from minizero.memory import SavedTensors
from minizero.sparse import (BigBirdSparsityConfig, DenseSparsityConfig, FixedSparsityConfig, attention_flops,
                             block_sparse_attention, dense_attention_flops, dense_mask, dense_score_bytes, density,
                             masked_dense_attention, score_bytes)

# head_dim unlike the block (16): the saved scores [b, nnz, 16, 16] are then told from the gathered
# query/key/value blocks [b, nnz, 16, head_dim] by their shape alone
SHAPE = {"batch": 1, "heads": 4, "head_dim": 32}


def configs(heads=SHAPE["heads"], block=16):
    """The layouts the figures compare, causal as TinyGPT's attention (DeepSpeed's defaults otherwise)."""
    return {"fixed": FixedSparsityConfig(heads, block=block, num_local_blocks=4, num_global_blocks=1,
                                         attention="unidirectional"),
            "bigbird": BigBirdSparsityConfig(heads, block=block, num_random_blocks=1, num_sliding_window_blocks=3,
                                             num_global_blocks=1, attention="unidirectional")}


def causal_blocks(heads=SHAPE["heads"], block=16):
    """Every block on or below the diagonal: the block code's dense causal attention."""
    return DenseSparsityConfig(heads, block=block, attention="unidirectional")


BASELINES = ("dense", "causal", "sdpa")


def _qkv(batch, heads, n, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, head_dim, generator=g).requires_grad_() for _ in range(3)]


def dense_causal(q, k, v):
    """Dense causal attention as TinyGPT writes it (models.py): n x n scores, the future masked."""
    n = q.shape[-2]
    return masked_dense_attention(q, k, v, torch.ones(n, n, dtype=torch.bool).tril())


def _config(kind, config):
    return causal_blocks(block=config.block if config else 16) if kind == "causal" else config


def _run(kind, config, q, k, v, layout=None):
    if kind == "dense":
        return dense_causal(q, k, v)
    if kind == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    config = _config(kind, config)
    layout = config.make_layout(q.shape[-2]) if layout is None else layout
    return block_sparse_attention(q, k, v, layout, config.block, config.causal)


def measure(kind, config, n, batch=SHAPE["batch"], heads=SHAPE["heads"], head_dim=SHAPE["head_dim"]) -> dict:
    """One forward: saved bytes (all, and the score-shaped ones) and matmul FLOPs, with the formulas."""
    q, k, v = _qkv(batch, heads, n, head_dim)
    with SavedTensors() as saved, FlopCounterMode(display=False) as counter:
        _run(kind, config, q, k, v)
    shapes = saved.shapes.get("other", [])
    if kind in ("dense", "sdpa"):
        scores = sum(b for s, dt, b in shapes if s == (batch, heads, n, n) and "float" in dt)
        formula = dense_score_bytes(batch, heads, n, 4) if kind == "dense" else 0
        flops_formula, kept = dense_attention_flops(batch, heads, n, head_dim), 1.0
    else:
        config = _config(kind, config)
        layout, B = config.make_layout(n), config.block
        scores = sum(b for s, dt, b in shapes if len(s) == 4 and s[-2:] == (B, B) and "float" in dt)
        formula = score_bytes(layout, batch, B, 4, config.causal)
        flops_formula = attention_flops(layout, batch, B, head_dim, config.causal)
        kept = density(layout, config.causal)
    return {"kind": kind, "n": n, "saved_bytes": saved.total, "score_bytes": scores, "score_bytes_formula": formula,
            "flops": counter.get_total_flops(), "flops_formula": flops_formula, "density": kept}


def scaling(seq_lens=(256, 512, 1024, 2048), block=16, baselines=("dense",)) -> list[dict]:
    """Per n: a row per baseline (kind "dense", "causal", "sdpa") and per layout of configs()."""
    rows = []
    for n in seq_lens:
        rows += [{**measure(kind, None, n), "kind": kind} for kind in baselines]
        for name, config in configs(block=block).items():
            rows.append({**measure("sparse", config, n), "kind": name})
    return rows


def longest_under_cap(kind, config, cap_bytes, step=256, limit=65536) -> int:
    """The longest sequence (a multiple of `step`) whose measured saved bytes fit under cap_bytes:
    doubling, then bisection. Assumes the bytes grow with n (they do: every layout keeps the diagonal)."""
    fits = lambda n: measure(kind, config, n)["saved_bytes"] <= cap_bytes  # noqa: E731
    if not fits(step):
        return 0
    lo = step
    while lo * 2 <= limit and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, limit + step)  # hi does not fit (or is past the limit)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def step_seconds(kind, config, n, repeats=3, batch=SHAPE["batch"], heads=SHAPE["heads"],
                 head_dim=SHAPE["head_dim"]) -> float:
    """Median wall time of forward + backward of one attention layer (the layout built beforehand)."""
    q, k, v = _qkv(batch, heads, n, head_dim)
    layout = None if kind in ("dense", "sdpa") else _config(kind, config).make_layout(n)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = _run(kind, config, q, k, v, layout)
        out.sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dense_layout_check(n=256, block=16):
    """The block-sparse code with every causal block kept against dense causal attention: the
    largest difference (a sanity figure for the tables)."""
    q, k, v = _qkv(1, SHAPE["heads"], n, SHAPE["head_dim"])
    config = DenseSparsityConfig(SHAPE["heads"], block=block, attention="unidirectional")
    layout = config.make_layout(n)
    out = block_sparse_attention(q, k, v, layout, block, True)
    ref = masked_dense_attention(q, k, v, dense_mask(layout, block, True))
    return float((out - ref).abs().max().detach())


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m minizero_course.experiments.sparse",
                                 description="dense vs block-sparse attention, one layer: bytes, FLOPs, time")
    ap.add_argument("--cap-mib", type=float, default=64.0, help="the saved-bytes cap of the longest-sequence search")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"one attention layer, fp32, batch {SHAPE['batch']}, {SHAPE['heads']} heads, head_dim "
          f"{SHAPE['head_dim']}, block 16, causal; torch {torch.__version__}")
    print(f"{'layout':8} {'n':>6} {'density':>8} {'score MB':>9} {'formula':>9} {'GFLOP':>8} {'formula':>8} "
          f"{'saved MB':>9}")
    for r in scaling():
        print(f"{r['kind']:8} {r['n']:6d} {r['density']:8.3f} {r['score_bytes'] / 2**20:9.3f} "
              f"{r['score_bytes_formula'] / 2**20:9.3f} {r['flops'] / 1e9:8.4f} {r['flops_formula'] / 1e9:8.4f} "
              f"{r['saved_bytes'] / 2**20:9.3f}")
    cap = int(args.cap_mib * 2**20)
    longest = {"dense": longest_under_cap("dense", None, cap)}
    for name, config in configs().items():
        longest[name] = longest_under_cap("sparse", config, cap)
    print(f"longest sequence whose saved bytes fit in {cap / 2**20:.0f} MiB: "
          + ", ".join(f"{k} {v}" for k, v in longest.items())
          + "; ratio to dense: " + ", ".join(f"{k} {v / longest['dense']:.1f}x" for k, v in longest.items()))
    for n in (1024, 2048, 4096):
        dense = step_seconds("dense", None, n)
        sparse = {name: step_seconds("sparse", c, n) for name, c in configs().items()}
        print(f"forward+backward n={n}: dense {dense * 1e3:.1f} ms, "
              + ", ".join(f"{k} {v * 1e3:.1f} ms ({dense / v:.2f}x)" for k, v in sparse.items()))
    print(f"dense layout vs dense attention, max |diff|: {dense_layout_check():.2e}")


if __name__ == "__main__":
    main()


# Lesson 15's conclusions, written from the run's figures: one sentence per outcome.
def _x(a, b):
    return a / b if b else float("inf")


def _mib(b):
    return b / 2**20


def describe_memory(rows: list[dict], n: int) -> str:
    """Score bytes at n split into causality (naive dense over the causal blocks) and sparsity
    (causal blocks over a layout's), and what torch's SDPA keeps. rows: scaling() with every
    baseline."""
    at = {r["kind"]: r for r in rows if r["n"] == n}
    dense, causal, sdpa = at["dense"], at["causal"], at["sdpa"]
    layouts = [k for k in at if k not in BASELINES]
    causality = _x(dense["score_bytes"], causal["score_bytes"])
    s = (f"At n = {n} the naive dense attention keeps {_mib(dense['score_bytes']):.1f} MiB of "
         f"scores; the causal blocks alone keep {_mib(causal['score_bytes']):.1f} MiB, "
         f"{causality:.2f}× less: that much of every saving against the naive dense is "
         "**causality** (it computes and masks the upper half, the block code skips it). ")
    for k in layouts:
        r = at[k]
        s += (f"{k} keeps {_x(dense['score_bytes'], r['score_bytes']):.1f}× fewer score bytes "
              f"than the naive dense, but {_x(causal['score_bytes'], r['score_bytes']):.1f}× fewer "
              f"than the causal blocks: that part is **sparsity** (its density is "
              f"{r['density']:.3f}, 1/density = {1 / r['density']:.1f}). ")
    best = min(layouts, key=lambda k: at[k]["saved_bytes"])
    lean = f"{best}, {_mib(at[best]['saved_bytes']):.2f} MiB"
    s += (f"torch's SDPA keeps {_mib(sdpa['score_bytes']):.0f} MiB of scores: all it saves for "
          f"backward is {_mib(sdpa['saved_bytes']):.2f} MiB (q, k, v, the output and one "
          "log-sum-exp per row), ")
    if sdpa["saved_bytes"] <= at[best]["saved_bytes"]:
        s += (f"no more than the leanest layout ({lean}). Against a FlashAttention-style dense "
              "attention, block sparsity saves no memory here; it saves FLOPs.")
    else:
        s += (f"more than the leanest layout ({lean}): at this n sparsity still saves memory "
              "against it, though far less than against the naive dense.")
    return s


def describe_longest(longest: dict, cap: int) -> str:
    """longest: kind -> tokens under cap (dense, causal, sdpa and the layouts)."""
    layouts = [k for k in longest if k not in BASELINES]
    best = max(layouts, key=longest.get)
    b, dense, causal, sdpa = longest[best], longest["dense"], longest["causal"], longest["sdpa"]
    s = (f"Under {_mib(cap):.0f} MiB {best} reaches {b} tokens: {_x(b, dense):.1f}× the naive "
         f"dense ({dense}), {_x(b, causal):.1f}× the causal blocks ({causal}, so "
         f"{_x(causal, dense):.1f}× of the first ratio is causality) and {_x(b, sdpa):.2f}× SDPA "
         f"({sdpa}). ")
    if b > sdpa:
        s += ("Even against a dense attention that keeps no scores the layout fits a longer "
              "sequence: its kept probabilities take less per token than SDPA's q, k, v and "
              "output. ")
    else:
        s += ("Against a dense attention that keeps no scores the layout fits no longer a "
              "sequence: what block sparsity buys over FlashAttention-style attention is FLOPs, "
              "not memory. ")
    r = _x(b, dense)
    s += ("DeepSpeed's 10× (BERT-base) and 16× (BERT-large) compare whole models on one 32 GB "
          "V100 at batch 1, sparse attention with activation checkpointing against dense with and "
          "without it: whole-model memory, where weights, optimizer states and the other "
          f"activations count too. This is one attention layer's saved bytes: {best}'s {r:.1f}× "
          "against the naive dense "
          + ("reaches 10× here, " if r >= 10 else "stays below 10× here, ")
          + "and the ratio grows with the cap (dense quadratic, the layout linear), so it "
          "reproduces the mechanism, not the figure.")
    return s


def describe_speed(times: dict, densities: dict) -> str:
    """times: n -> kind -> seconds (forward + backward of one layer); densities: layout -> density
    at the largest n whose times hold the causal blocks."""
    layouts = [k for k in densities if any(k in t for t in times.values())]
    n = max(times)
    t = times[n]
    s = ("DeepSpeed's \"up to 6x faster\" (6.3×, 5.3× and 6.1× in its chart) is a whole model's "
         "training iteration (BERT and GPT-2 pretraining) with the Fixed layout on its Triton "
         f"kernels. This lesson times one attention layer on a CPU. At n = {n}: ")
    parts = []
    for k in layouts:
        p = f"{k} {_x(t['dense'], t[k]):.1f}× faster than the naive dense"
        if "sdpa" in t:
            r = _x(t["sdpa"], t[k])
            p += f", {r:.1f}× " + ("faster than" if r >= 1 else "the speed of") + " SDPA"
        parts.append(p)
    s += "; ".join(parts) + ". "
    with_causal = [m for m in sorted(times) if "causal" in times[m]]
    if with_causal:
        m = with_causal[-1]
        for k in layouts:
            r, d = _x(times[m]["causal"], times[m][k]), densities[k]
            s += (f"Against the causal blocks of the same code at n = {m}, {k} is {r:.1f}× faster, "
                  f"for 1/density = {1 / d:.1f}: "
                  + ("about what sparsity allows. " if abs(r * d - 1) <= 0.3 else
                     "more than 1/density. " if r * d > 1.3 else "less than 1/density. "))
    fixed = [_x(times[m]["dense"], times[m]["fixed"]) for m in times if "fixed" in times[m]]
    if fixed:
        s += (f"Fixed, the announcement's layout, gave {min(fixed):.1f}-{max(fixed):.1f}× against "
              "the naive dense "
              + ("(6× or more, but " if max(fixed) >= 6 else "(below 6×; ")
              + "for one layer against a baseline that keeps the scores: not the claim's "
              "measurement). ")
    s += ("A layer's speed-up bounds a model's from above: the projections, the MLP and the "
          "optimizer do not get faster.")
    return s
