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
    # heads 3 and 4 wrap round to patterns 0 and 1; 11 blocks end in a short window of 3, whose
    # global block depends on the head (bidirectional: a causal one hides in its window's triangle)
    "5 heads, 3 patterns, short last window": (
        {"num_local_blocks": 4, "different_layout_per_head": True,
         "num_different_global_patterns": 3, "num_heads": 5}, 11),
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


# what the usual slips compute: the reference's forward with one step changed (_slipped's switches)
SLIPS = {"unscaled": {"scale": 1.0}, "scale_twice": {"scale": 1 / SHAPE[3]},
         "no_token_mask": {"mask": "none"}, "mask_every_block": {"mask": "every"},
         "keys_at_i": {"keys": "i"}, "values_at_i": {"values": "i"},
         "rows_without_head": {"row": "no_head"}, "out_at_key_row": {"out_row": "key"},
         "per_block": {"per_block": True}}


def forward_phase(comm, mod):
    out = {}
    for name, (config, causal) in FORWARD_CASES.items():
        layout = config.make_layout(SHAPE[2])
        for scale in (1.0, LARGE):
            (q, k, v), grad = _qkv(3, scale)
            key, dtype = f"{name}/{scale:g}", str(q.dtype).removeprefix("torch.")
            try:
                y = mod.block_sparse_attention(q, k, v, layout, config.block, causal)
                grads = torch.autograd.grad(y, (q, k, v), grad)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. a buffer of another dtype: judged
                out[key] = {"raised": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                            "dtype": dtype}
                continue
            want = _dense(q, k, v, layout, config.block, causal)
            want_grads = torch.autograd.grad(want, (q, k, v), grad)
            y, want = y.detach(), want.detach()
            with torch.no_grad():
                candidates = {slip: _slipped(q, k, v, layout, config.block, causal, **kw)
                              for slip, kw in SLIPS.items()}
            out[key] = {
                "out": _diff(y, want), "finite": bool(torch.isfinite(y).all()), "scale": scale,
                "dtype": dtype,
                "out_dtype": str(y.dtype).removeprefix("torch."),
                "grads": max(_diff(a, b) for a, b in zip(grads, want_grads)),
                **{k_: _diff(y, c) for k_, c in candidates.items()}}
    return out


def _slipped(q, k, v, layout, block, causal, scale=None, keys="j", values="j", mask="diagonal",
             row="query", out_row=None, per_block=False):
    """The block-sparse forward as the reference computes it, with one step changed: keys / values
    gathered at block "i" or "j"; the causal token mask on the "diagonal" blocks, on "every" kept
    block or "none"; the softmax's rows "query" (h * nb + i), "no_head" (i) or "key" (h * nb + j),
    the output's rows out_row (None: the softmax's); per_block: each block normalized alone."""
    h, i, j = ref_attention.kept_blocks(layout, causal)
    B, H, T, d = q.shape
    nb = T // block
    scale = 1 / math.sqrt(d) if scale is None else scale
    qb, kb, vb = (t.view(B, H, nb, block, d) for t in (q, k, v))
    at = {"i": i, "j": j}
    s = (qb[:, h, i] @ kb[:, h, at[keys]].transpose(-2, -1)) * scale
    if causal and mask != "none":
        n = int((i == j).sum()) if mask == "diagonal" else len(i)
        future = torch.ones(block, block, dtype=torch.bool).triu(1)
        s[:, :n] = s[:, :n].masked_fill(future, float("-inf"))
    rows = {"query": h * nb + i, "no_head": i, "key": h * nb + j}
    r = rows[row]
    if per_block:
        p = s.softmax(-1)
    else:
        top = torch.full((B, H * nb, block), float("-inf"), dtype=q.dtype)
        top = top.index_reduce_(1, r, s.amax(-1), "amax")
        p = torch.exp(s - top[:, r].unsqueeze(-1))
        total = torch.zeros(B, H * nb, block, dtype=q.dtype).index_add_(1, r, p.sum(-1))
        p = p / total[:, r].unsqueeze(-1)
    o = p @ vb[:, h, at[values]]
    out = torch.zeros(B, H * nb, block, d, dtype=q.dtype).index_add_(1, rows[out_row or row], o)
    return out.view(B, H, T, d)


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
        L, patterns = kwargs["num_local_blocks"], kwargs.get("num_different_global_patterns", 1)
        short = n - n % L  # the short last window's first block (n when there is none)
        if causal and any(j > i for _, i, j in extra):
            why = ("a unidirectional layout keeps blocks above the diagonal: a window's query block i sees its "
                   "window's blocks up to i only, and a global column starts at the global block's own row")
        elif len(mine) > 1 and mine[0] == mine[1] and want[0] != want[1]:
            why = ("every head got the same global blocks: head h's are (h mod num_different_global_patterns) x "
                   "num_global_blocks earlier in each window")
        elif len(mine) > patterns > 1 and mine[:patterns] == want[:patterns]:
            why = (f"heads 0..{patterns - 1} are right, the heads after them are not: head h takes "
                   f"pattern h mod num_different_global_patterns (head {patterns} repeats head 0's "
                   "global blocks)")
        elif patterns > 1 and extra and missing and all(j >= short for _, _, j in extra + missing):
            why = ("the short last window's global blocks move with the head's pattern as every "
                   "window's do: head h's start at min(end + offset_h, nb - G), offset_h = "
                   "L - (1 + h mod patterns) * G")
        elif kwargs.get("horizontal_global_attention") and not any(all(row) for row in mine[0]):
            why = "horizontal_global_attention: the global blocks' rows attend to every block too"
        elif missing and all(j >= short for _, _, j in missing):
            why = ("the short last window has no global block: DeepSpeed gives it one, min(end + offset, nb - G), "
                   "clipped into the sequence")
        else:
            why = ("the global blocks are the LAST num_global_blocks of each window of num_local_blocks; local "
                   "windows start at block 0 and do not overlap")
        raise CheckFailed(f"{name} ({n} blocks): your layout keeps {extra or 'no extra'} and misses "
                          f"{missing or 'none'} (head, query block, key block): {why}")
    return (f"the fixed layout equals DeepSpeed's for {len(LAYOUT_CASES)} configs "
            "(uni/bidirectional, short window, horizontal, per head, more heads than patterns)")


# the slips' causes, in the order they are tried (SLIPS' names)
SLIP_CAUSES = {
    "unscaled": "the scores are not scaled by 1/sqrt(head_dim)",
    "scale_twice": ("the scores are scaled by 1/head_dim: the scale was applied twice; once, "
                    "1/sqrt(head_dim)"),
    "no_token_mask": ("the diagonal blocks are not causally masked: a query sees later keys of its "
                      "own block"),
    "mask_every_block": ("the causal token mask was applied to every kept block: only the diagonal "
                         "blocks (the first (i == j).sum() kept blocks) hold later keys; an "
                         "earlier block's keys are all in the past"),
    "keys_at_i": ("the key blocks were gathered at the query block's index i[n]: block n's scores "
                  "are query block i[n] against KEY block j[n] (the values too)"),
    "values_at_i": ("the value blocks were gathered at the query block's index i[n]: block n's "
                    "probabilities multiply VALUE block j[n] (the key block's own values)"),
    "rows_without_head": ("the heads' rows were merged: a kept block's query row is h * nb + i "
                          "over all heads (row = i shares one softmax among the heads and sends "
                          "every output to head 0)"),
    "out_at_key_row": ("each block's P V was added into the key block's row h * nb + j: it belongs "
                       "to its query block's row h * nb + i, the row its softmax ran over"),
    "per_block": ("each kept block is normalized on its own: the softmax runs over a query row's "
                  "kept blocks together (the max and the sum reduced per row h * nb + i)"),
}


def judge_forward(results) -> str:
    res = first_phase(results, "forward")[0]
    passed = {key.split("/")[0] for key, r in res.items() if "raised" not in r}
    for key, r in res.items():
        if "raised" in r:
            dtype = r["dtype"]
            if dtype != "float32" and key.split("/")[0] in passed or "scalar type" in r["raised"] \
                    or "dtype" in r["raised"]:
                raise CheckFailed(f"{key}: with {dtype} q, k, v your forward raised {r['raised']}: "
                                  "a buffer made without dtype= is float32 (torch's default), and "
                                  "index_add_/scatter_reduce do not mix dtypes: make every buffer "
                                  f"in q's dtype (dtype=q.dtype), {dtype} here")
            raise CheckFailed(f"{key}: your forward raised {r['raised']}")
        if r["out_dtype"] != r["dtype"]:
            raise CheckFailed(f"{key}: {r['dtype']} q, k, v gave a {r['out_dtype']} output: make "
                              "every buffer in q's dtype (dtype=q.dtype), not torch's default "
                              "float32")
        if not r["finite"]:
            if r["scale"] == 1.0:
                raise CheckFailed(f"{key}: the output is not finite at ordinary scores (float32 "
                                  "q, k ~ N(0, 1): exp() cannot overflow): a query row has every "
                                  "score masked (-inf, then 0/0): each query keeps its own key and "
                                  "the earlier ones (the causal mask is triu(1), strictly above the "
                                  "diagonal)")
            raise CheckFailed(f"{key}: the output is not finite: at large scores exp() overflows; subtract each "
                              "query row's maximum over its kept blocks before exp")
        if r["out"] > ATOL:
            why = next((cause for slip, cause in SLIP_CAUSES.items() if r[slip] <= ATOL),
                       "it differs from dense attention under the layout's mask: query block i[n] "
                       "meets key and value block j[n] of head h[n], and each row's output sums "
                       "its blocks' P V")
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
    Check("the fixed layout equals DeepSpeed's (6 configs)", 3,
          judged_check(judge_layout, measured)),
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
