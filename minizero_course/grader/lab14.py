"""Lab 14 checks: your fixed block layout (minizero/sparse/layout.py) and your block-sparse attention
forward (minizero/sparse/attention.py) against the reference and against dense attention.

ONE 2-rank job measures everything (`measure_worker`); each check judges its part (`judge_*`), so the
grader launches once per submission and the mutation suite (tests/mutants/lab14.py) grades all its
mutants in one job too. Phases, on every rank:
  layout   FixedSparsityConfig.make_layout for hand-picked configs (uni/bidirectional, a short last window,
           two global blocks, horizontal global attention, a global pattern per head) against the reference
  forward  block_sparse_attention (your sparse_forward, the given backward) on reference layouts, causal and
           bidirectional, at ordinary and large scores: output against dense attention under the layout's
           mask, gradients too; the diagnostic candidates of the usual slips
  cost     the matmul FLOPs (torch's FlopCounterMode) against 4·b·nnz·B²·d: only the kept blocks computed
  random   (stretch) your random blocks under a different global RNG seed per rank: equal across ranks,
           `count` distinct blocks per row, none in the future when causal, another seed another layout
A phase that raises in your code is recorded (with the error) and the next phase runs.
"""
from __future__ import annotations

import math

import torch

from minizero_course.grader import Check, CheckFailed, Lab, first_phase, judged_check, launched_once
from minizero_course.grader.lab10 import _phase_or_todo, measure_phases
from minizero.sparse import attention as ref_attention
from minizero.sparse import layout as ref_layout

LAB = Lab(14, "sparse_attention", "Sparse attention: the fixed block layout and the block-sparse forward",
          ("minizero/sparse/layout.py", "minizero/sparse/attention.py"), nprocs=2)

ATOL = 1e-5  # float32: the per-row sums add the blocks in another order than dense attention's softmax
LARGE = 400.0  # q scaled by this, in float64: scores ~ 1e3, past exp()'s range (709) without the row maximum

LAYOUT_CASES = {  # name: (FixedSparsityConfig kwargs, seq_len with block 1)
    "bidirectional, 2 local": ({"num_local_blocks": 2}, 5),
    "unidirectional, 4 local, short last window": ({"num_local_blocks": 4, "attention": "unidirectional"}, 10),
    "unidirectional, 4 local, 2 global": ({"num_local_blocks": 4, "num_global_blocks": 2,
                                          "attention": "unidirectional"}, 8),
    "horizontal global": ({"num_local_blocks": 2, "horizontal_global_attention": True}, 6),
    "a pattern per head": ({"num_local_blocks": 2, "different_layout_per_head": True,
                            "num_different_global_patterns": 2, "num_heads": 2}, 4),
}
FORWARD_CASES = {  # name: (layout config, causal)
    "fixed causal": (ref_layout.FixedSparsityConfig(2, block=4, num_local_blocks=2, attention="unidirectional"), True),
    "bigbird bidirectional": (ref_layout.BigBirdSparsityConfig(2, block=4, num_random_blocks=1,
                                                               different_layout_per_head=True), False),
    "bslongformer causal": (ref_layout.BSLongformerSparsityConfig(2, block=4, global_block_indices=[1],
                                                                  attention="unidirectional"), True),
}
SHAPE = (2, 2, 32, 8)  # batch, heads, tokens, head_dim: 8 blocks of 4


def _diff(a, b) -> float:
    if tuple(a.shape) != tuple(b.shape):
        return float("inf")
    d = (a.double() - b.double()).abs().max().item()
    return float("inf") if d != d else d


# ------------------------------------------------------------------------------ the phases
def layout_phase(comm, mod):
    out = {}
    for name, (kwargs, n) in LAYOUT_CASES.items():
        kwargs = {"num_heads": 1, **kwargs}
        mine = mod.FixedSparsityConfig(block=1, **kwargs).make_layout(n)
        want = ref_layout.FixedSparsityConfig(block=1, **kwargs).make_layout(n)
        out[name] = {"mine": mine.int().tolist(), "want": want.int().tolist()}
    return out


def _qkv(seed, scale):
    """q, k, v and an output gradient; at a large scale in float64, so that only an overflow can break it."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if scale == 1.0 else torch.float64
    q, k, v, grad = (torch.randn(*SHAPE, generator=g, dtype=dtype) for _ in range(4))
    return [t.requires_grad_() for t in (q * scale, k, v)], grad


def _dense(q, k, v, layout, block, causal, scale=None, token_mask=True):
    """Dense attention under the layout's mask (token_mask=False: the diagonal blocks left unmasked)."""
    mask = ref_attention.dense_mask(layout.tril() if causal else layout, block, causal and token_mask)
    return ref_attention.masked_dense_attention(q, k, v, mask, scale)


def forward_phase(comm, mod):
    out = {}
    for name, (config, causal) in FORWARD_CASES.items():
        layout = config.make_layout(SHAPE[2])
        for scale in (1.0, LARGE):
            (q, k, v), grad = _qkv(3, scale)
            y = mod.block_sparse_attention(q, k, v, layout, config.block, causal)
            want = _dense(q, k, v, layout, config.block, causal)
            grads = torch.autograd.grad(y, (q, k, v), grad)
            want_grads = torch.autograd.grad(want, (q, k, v), grad)
            y, want = y.detach(), want.detach()
            with torch.no_grad():
                d = SHAPE[3]
                candidates = {  # what the usual slips compute
                    "unscaled": _dense(q, k, v, layout, config.block, causal, scale=1.0),
                    "no_token_mask": _dense(q, k, v, layout, config.block, causal, token_mask=False),
                    "per_block": _per_block_softmax(q, k, v, layout, config.block, causal, 1 / math.sqrt(d)),
                    "keys_at_i": _keys_at_query_block(q, k, v, layout, config.block, causal, 1 / math.sqrt(d)),
                }
            out[f"{name}/{scale:g}"] = {
                "out": _diff(y, want), "finite": bool(torch.isfinite(y).all()),
                "grads": max(_diff(a, b) for a, b in zip(grads, want_grads)),
                **{k_: _diff(y, c) for k_, c in candidates.items()}}
    return out


def _per_block_softmax(q, k, v, layout, block, causal, scale):
    """The slip of normalizing each kept block on its own: every block's softmax, summed over the row's blocks."""
    h, i, j = ref_attention.kept_blocks(layout, causal)
    B, H, T, d = q.shape
    nb = T // block
    qb, kb, vb = (t.view(B, H, nb, block, d) for t in (q, k, v))
    s = (qb[:, h, i] @ kb[:, h, j].transpose(-2, -1)) * scale
    if causal:
        n_diag = int((i == j).sum())
        s[:, :n_diag] = s[:, :n_diag].masked_fill(torch.ones(block, block, dtype=torch.bool).triu(1), float("-inf"))
    o = s.softmax(-1) @ vb[:, h, j]
    return torch.zeros(B, H * nb, block, d, dtype=q.dtype).index_add_(1, h * nb + i, o).view(B, H, T, d)


def _keys_at_query_block(q, k, v, layout, block, causal, scale):
    """The slip of gathering the KEY blocks at the query block's index i[n] (values at j[n]): the softmax over
    each row's kept blocks, as the reference does, but with scores against the wrong keys."""
    h, i, j = ref_attention.kept_blocks(layout, causal)
    B, H, T, d = q.shape
    nb = T // block
    qb, kb, vb = (t.view(B, H, nb, block, d) for t in (q, k, v))
    s = (qb[:, h, i] @ kb[:, h, i].transpose(-2, -1)) * scale
    if causal:
        n_diag = int((i == j).sum())
        s[:, :n_diag] = s[:, :n_diag].masked_fill(torch.ones(block, block, dtype=torch.bool).triu(1), float("-inf"))
    row = h * nb + i
    top = torch.full((B, H * nb, block), float("-inf"), dtype=q.dtype).index_reduce_(1, row, s.amax(-1), "amax")
    p = torch.exp(s - top[:, row].unsqueeze(-1))
    total = torch.zeros(B, H * nb, block, dtype=q.dtype).index_add_(1, row, p.sum(-1))
    o = (p / total[:, row].unsqueeze(-1)) @ vb[:, h, j]
    return torch.zeros(B, H * nb, block, d, dtype=q.dtype).index_add_(1, row, o).view(B, H, T, d)


def cost_phase(comm, mod):
    from torch.utils.flop_counter import FlopCounterMode
    out = {}
    for name, (config, causal) in FORWARD_CASES.items():
        layout = config.make_layout(SHAPE[2])
        (q, k, v), _ = _qkv(4, 1.0)
        with FlopCounterMode(display=False) as counter:
            mod.block_sparse_attention(q, k, v, layout, config.block, causal)
        b, heads, n, d = SHAPE
        out[name] = {"flops": counter.get_total_flops(),
                     "formula": ref_attention.attention_flops(layout, b, config.block, d, causal),
                     "dense": ref_attention.dense_attention_flops(b, heads, n, d)}
    return out


def random_phase(comm, mod):
    try:  # an untouched stretch task costs the main checks nothing: its stub is recorded, not raised
        return _random(comm, mod)
    except NotImplementedError as e:  # the same stub on every rank (this phase runs no collective)
        return {"stub": str(e)}


def _random(comm, mod):
    torch.manual_seed(100 + comm.rank)  # the global RNG differs per rank: a layout drawn from it would too
    out = {}
    for causal in (False, True):
        layouts = []
        for seed in (5, 5, 6):
            layout = torch.zeros(12, 12, dtype=torch.bool)
            mod._random_blocks(layout, 3, torch.Generator().manual_seed(seed), causal)
            layouts.append(layout)
        out[f"causal={causal}"] = {"layout": layouts[0].int().tolist(), "again": bool(torch.equal(*layouts[:2])),
                                   "other_seed": bool(torch.equal(layouts[0], layouts[2])),
                                   "row_sums": layouts[0].sum(1).tolist(), "future": int(layouts[0].triu(1).sum())}
    config = mod.BigBirdSparsityConfig(1, block=1, num_random_blocks=2, num_sliding_window_blocks=1, seed=9)
    out["bigbird"] = config.make_layout(16).int().tolist()
    return out


PHASES = {"layout": layout_phase, "forward": forward_phase, "cost": cost_phase, "random": random_phase}


def measure_worker(comm, impls: list[str], phases=tuple(PHASES)) -> dict:
    """{impl: {phase: result}} for each file, for the phases asked: each task graded on its own
    (a stub or a crash in one fails only the checks that need it)."""
    return measure_phases(comm, impls, PHASES, phases, run=_phase_or_todo)


def measured(impl: str) -> list:
    """One 2-rank run per file, shared by the checks (each phase's error is its own check's)."""
    return [r[impl] for r in
            launched_once("minizero_course.grader.lab14:measure_worker", 2, {"impls": [impl]}, 240)]


# ------------------------------------------------------------------------------ the judges
def _cells(grid) -> list:
    return [(h, i, j) for h, rows in enumerate(grid) for i, row in enumerate(rows) for j, c in enumerate(row) if c]


def judge_layout(results) -> str:
    res = first_phase(results, "layout")[0]
    for name, (kwargs, n) in LAYOUT_CASES.items():
        mine, want = res[name]["mine"], res[name]["want"]
        if mine == want:
            continue
        extra = sorted(set(_cells(mine)) - set(_cells(want)))
        missing = sorted(set(_cells(want)) - set(_cells(mine)))
        causal = kwargs.get("attention") == "unidirectional"
        if causal and any(j > i for _, i, j in extra):
            why = ("a unidirectional layout keeps blocks above the diagonal: a window's query block i sees its "
                   "window's blocks up to i only, and a global column starts at the global block's own row")
        elif len(mine) > 1 and mine[0] == mine[1] and want[0] != want[1]:
            why = ("every head got the same global blocks: head h's are (h mod num_different_global_patterns) x "
                   "num_global_blocks earlier in each window")
        elif kwargs.get("horizontal_global_attention") and not any(all(row) for row in mine[0]):
            why = "horizontal_global_attention: the global blocks' rows attend to every block too"
        elif missing and all(j >= n - n % kwargs["num_local_blocks"] for _, _, j in missing):
            why = ("the short last window has no global block: DeepSpeed gives it one, min(end + offset, nb - G), "
                   "clipped into the sequence")
        else:
            why = ("the global blocks are the LAST num_global_blocks of each window of num_local_blocks; local "
                   "windows start at block 0 and do not overlap")
        raise CheckFailed(f"{name} ({n} blocks): your layout keeps {extra or 'no extra'} and misses "
                          f"{missing or 'none'} (head, query block, key block): {why}")
    return "the fixed layout equals DeepSpeed's for 5 configs (uni/bidirectional, short window, horizontal, per head)"


def judge_forward(results) -> str:
    res = first_phase(results, "forward")[0]
    for key, r in res.items():
        if not r["finite"]:
            raise CheckFailed(f"{key}: the output is not finite: at large scores exp() overflows; subtract each "
                              "query row's maximum over its kept blocks before exp")
        if r["out"] > ATOL:
            if r["unscaled"] <= ATOL:
                why = "the scores are not scaled by 1/sqrt(head_dim)"
            elif r["no_token_mask"] <= ATOL:
                why = "the diagonal blocks are not causally masked: a query sees later keys of its own block"
            elif r["keys_at_i"] <= ATOL:
                why = ("the key blocks were gathered at the query block's index i[n]: block n's scores are query block "
                       "i[n] against KEY block j[n] (the values too)")
            elif r["per_block"] <= ATOL:
                why = ("each kept block is normalized on its own: the softmax runs over a query row's kept blocks "
                       "together (the max and the sum reduced per row h * nb + i)")
            else:
                why = ("it differs from dense attention under the layout's mask: query block i[n] meets key and "
                       "value block j[n] of head h[n], and each row's output sums its blocks' P V")
            raise CheckFailed(f"{key}: the output differs from dense attention (max |diff| {r['out']:.3g}): {why}")
        if r["grads"] > 10 * ATOL:  # float32 at scale 1: 6e-7 measured
            raise CheckFailed(f"{key}: the output is right but the gradients are not (max |diff| {r['grads']:.3g}): "
                              "the given backward needs the normalized probabilities p (each row summing to 1) that "
                              "sparse_forward returns")
    return "equal to dense attention under the layout's mask, forward and gradients (3 layouts, large scores too)"


def judge_cost(results) -> str:
    res = first_phase(results, "cost")[0]
    for name, r in res.items():
        if r["flops"] != r["formula"]:
            why = (" (the dense count: every block was computed)" if r["flops"] >= r["dense"] else "")
            raise CheckFailed(f"{name}: {r['flops']} matmul FLOPs, expected 4·b·nnz·B²·d = {r['formula']}{why}: "
                              "compute the scores and P·V of the kept blocks only")
    return "matmul FLOPs = 4·b·nnz·B²·d: only the kept blocks are computed (dense would be more)"


def judge_random(results) -> str:
    ranks = first_phase(results, "random")
    if "stub" in ranks[0]:
        raise CheckFailed(ranks[0]["stub"])
    r = ranks[0]
    for case in ("causal=False", "causal=True"):
        c = r[case]
        if any(other[case]["layout"] != c["layout"] for other in ranks[1:]) or not c["again"]:
            raise CheckFailed(f"{case}: the random blocks differ between ranks (or between two builds with the same "
                              "seed): draw them from the `generator` argument, never from the global RNG, so that "
                              "every rank builds the same layout")
        if c["other_seed"]:
            raise CheckFailed(f"{case}: another seed gave the same layout: the blocks must come from the generator")
        if case == "causal=True" and c["future"]:
            raise CheckFailed("causal=True: random blocks above the diagonal: a causal row i draws among blocks 0..i")
        want = [min(3, i + 1) for i in range(12)] if case == "causal=True" else [3] * 12
        if c["row_sums"] != want:
            raise CheckFailed(f"{case}: blocks per row {c['row_sums']}, expected {want}: `count` DISTINCT blocks per "
                              "row (as many as there are, causal rows near the start)")
    return "random blocks: the same on every rank from the seeded generator, distinct, causal ones in the past"


CHECKS = [
    Check("the fixed layout equals DeepSpeed's (5 configs)", 3, judged_check(judge_layout, measured)),
    Check("block-sparse forward equals dense attention under the mask", 4, judged_check(judge_forward, measured)),
    Check("only the kept blocks are computed (FLOPs = formula)", 1, judged_check(judge_cost, measured)),
    Check("stretch: BigBird's random blocks, seeded, equal across ranks", 2, judged_check(judge_random, measured),
          extra=True),
]


def demo(comm, impl):
    """What `mpirun -n 2 python labs/lab14_sparse_attention.py` shows (rank 0 prints)."""
    if comm.rank:
        return
    config = impl.FixedSparsityConfig(2, block=16, num_local_blocks=4, attention="unidirectional")
    layout = config.make_layout(256)
    print("fixed layout, 16 blocks of 16, causal (head 0; # = kept):")
    for row in layout[0].tolist():
        print("  " + "".join("#" if c else "." for c in row))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(3))
    y = impl.block_sparse_attention(q, k, v, layout, 16, True)
    want = ref_attention.masked_dense_attention(q, k, v, ref_attention.dense_mask(layout, 16, True))
    print(f"block-sparse vs dense attention under the mask: max |diff| {_diff(y, want):.2e}; density "
          f"{ref_layout.density(layout, True):.2f}; score bytes {ref_attention.score_bytes(layout, 1, 16, 4, True)} "
          f"vs dense {ref_attention.dense_score_bytes(1, 2, 256, 4)}")
