"""Sparse attention, measured: what docs/sparse.md's figures, lesson 15 and lab 14 come from.

One attention layer, one process, fp32 on CPU (the same code runs on CUDA):
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


def _qkv(batch, heads, n, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, head_dim, generator=g).requires_grad_() for _ in range(3)]


def dense_causal(q, k, v):
    """Dense causal attention as TinyGPT writes it (models.py): n x n scores, the future masked."""
    n = q.shape[-2]
    return masked_dense_attention(q, k, v, torch.ones(n, n, dtype=torch.bool).tril())


def _run(kind, config, q, k, v):
    if kind == "dense":
        return dense_causal(q, k, v)
    return block_sparse_attention(q, k, v, config.make_layout(q.shape[-2]), config.block, config.causal)


def measure(kind, config, n, batch=SHAPE["batch"], heads=SHAPE["heads"], head_dim=SHAPE["head_dim"]) -> dict:
    """One forward: saved bytes (all, and the score-shaped ones) and matmul FLOPs, with the formulas."""
    q, k, v = _qkv(batch, heads, n, head_dim)
    with SavedTensors() as saved, FlopCounterMode(display=False) as counter:
        _run(kind, config, q, k, v)
    shapes = saved.shapes.get("other", [])
    if kind == "dense":
        scores = sum(b for s, dt, b in shapes if s == (batch, heads, n, n) and "float" in dt)
        formula = dense_score_bytes(batch, heads, n, 4)
        flops_formula, kept = dense_attention_flops(batch, heads, n, head_dim), 1.0
    else:
        layout, B = config.make_layout(n), config.block
        scores = sum(b for s, dt, b in shapes if len(s) == 4 and s[-2:] == (B, B) and "float" in dt)
        formula = score_bytes(layout, batch, B, 4, config.causal)
        flops_formula = attention_flops(layout, batch, B, head_dim, config.causal)
        kept = density(layout, config.causal)
    return {"kind": kind, "n": n, "saved_bytes": saved.total, "score_bytes": scores, "score_bytes_formula": formula,
            "flops": counter.get_total_flops(), "flops_formula": flops_formula, "density": kept}


def scaling(seq_lens=(256, 512, 1024, 2048), block=16) -> list[dict]:
    rows = []
    for n in seq_lens:
        rows.append(measure("dense", None, n))
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
    layout = None if kind == "dense" else config.make_layout(n)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if kind == "dense":
            out = dense_causal(q, k, v)
        else:
            out = block_sparse_attention(q, k, v, layout, config.block, config.causal)
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
