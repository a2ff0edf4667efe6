"""Lab 11 checks: your block attention and online-softmax merge (minizero/context/online_softmax.py)
against torch's scaled_dot_product_attention and torch.logsumexp, then inside ring attention.

ONE 4-rank job measures everything (`measure_worker`); each check judges its part (`judge_*`), so
the grader launches once per submission and the mutation suite (tests/mutants/lab11.py) grades all
its mutants in one job too. Phases:
  block   block_attention on one block, causal (diagonal) and not, at ordinary and at large scores
          (|s| ~ 1e3, where exp(s) overflows float32): o_B and L_B against softmax and logsumexp
  merge   keys cut into 3 blocks, blocks from the REFERENCE block_attention folded with your merge
          in two orders: (o, L) against attention over all keys; the diagnostic candidates of the
          usual slips (max instead of logaddexp, no weights, swapped weights); whether `out` changed
  ring    ring_attention(kernels=your module) at cp=4, causal load-balanced and full: output and
          dq, dk, dv gathered against torch's attention (minizero.experiments.context)
A phase that raises in your code is recorded (with the error) and the next phase runs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minizero.autograde import Check, CheckFailed, Lab, first_phase, judged_check, launched_once
from minizero.autograde.lab10 import _phase, load
from minizero.context import online_softmax as reference

LAB = Lab(11, "ring_attention", "Ring attention: block attention and the online-softmax merge",
          "minizero/context/online_softmax.py")

ATOL = 5e-6  # float32: the merge reorders the softmax sums (tests/test_context.py says why)
LARGE = 40.0  # q and k scaled by this: scores ~ 1e3, exp() of them overflows float32


def _data(seed, *shape, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _diff(a, b) -> float:
    """Largest |a - b| (inf for a shape mismatch or a non-finite value where b is finite)."""
    if tuple(a.shape) != tuple(b.shape):
        return float("inf")
    d = (a.float() - b.float()).abs().max().item()
    return float("inf") if d != d else d


def _scores(q, k, causal):
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return s.masked_fill(reference.causal_mask(q.size(-2), k.size(-2), q.device), float("-inf")) if causal else s


def block_phase(mod):
    out = {}
    for scale in (1.0, LARGE):
        for causal in (False, True):
            q, k, v = (_data(i, 1, 2, 6, 4, scale=scale if i < 2 else 1.0) for i in range(3))
            o, lse = mod.block_attention(q, k, v, causal=causal)
            scores = _scores(q, k, causal)
            out[f"{scale:g}/{causal}"] = {
                "lse_shape": list(lse.shape), "o_shape": list(o.shape),
                "lse": _diff(lse, torch.logsumexp(scores, -1)),
                "o": _diff(o, F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
                "o_unnormalized": _diff(o, torch.exp(scores) @ v),
                "o_wrong_dim": _diff(o, torch.softmax(scores, -2) @ v)}
    return out


def merge_phase(mod):
    out = {}
    for scale in (1.0, LARGE):
        q, k, v = _data(10, 1, 2, 6, 4, scale=scale), _data(11, 1, 2, 12, 4, scale=scale), _data(12, 1, 2, 12, 4)
        blocks = [reference.block_attention(q, kb, vb) for kb, vb in zip(k.chunk(3, -2), v.chunk(3, -2))]
        want_o, want_lse = F.scaled_dot_product_attention(q, k, v), torch.logsumexp(_scores(q, k, False), -1)
        (o1, l1), (o2, l2) = blocks[0], blocks[1]
        first = o1.clone()
        two_o, two_lse = mod.merge(first, l1, o2, l2)
        res = {"in_place": _diff(first, o1) > 0, "lse_shape": list(two_lse.shape),
               "two_lse_is_max": _diff(two_lse, torch.maximum(l1, l2)), "two_lse_is_sum": _diff(two_lse, l1 + l2),
               "two_o_is_sum": _diff(two_o, o1 + o2), "two_o_is_mean": _diff(two_o, (o1 + o2) / 2),
               "two_lse": _diff(two_lse, torch.logaddexp(l1, l2))}
        merged = torch.logaddexp(l1, l2)
        w1, w2 = torch.exp(l1 - merged).unsqueeze(-1), torch.exp(l2 - merged).unsqueeze(-1)
        res["two_o"] = _diff(two_o, w1 * o1 + w2 * o2)
        res["two_o_swapped"] = _diff(two_o, w2 * o1 + w1 * o2)
        for name, order in (("forward", (0, 1, 2)), ("reverse", (2, 0, 1))):
            o, lse = None, None
            for i in order:
                o, lse = mod.merge(o, lse, *blocks[i])
            res[name] = {"o": _diff(o, want_o), "lse": _diff(lse, want_lse)}
        out[f"{scale:g}"] = res
    return out


def ring_phase(comm, mod):
    from minizero.experiments.context import attention_side_by_side
    return {f"{'causal, balanced' if causal else 'full'}": attention_side_by_side(comm, "ring", causal, causal,
                                                                                  kernels=mod)["max_diff"]
            for causal in (True, False)}


PHASES = ("block", "merge", "ring")


def measure_worker(comm, impls: list[str], phases=PHASES) -> dict:
    """{impl: {phase: result}} for each file."""
    torch.set_num_threads(1)
    out = {}
    for impl in impls:
        mod = _phase(comm, lambda: load(impl))
        if isinstance(mod, dict):
            out[impl] = {p: mod for p in PHASES}
            continue
        runs = {"block": lambda: block_phase(mod), "merge": lambda: merge_phase(mod),
                "ring": lambda: ring_phase(comm, mod)}
        out[impl] = {name: _phase(comm, runs[name]) for name in PHASES if name in phases}
    return out


def measured(impl: str) -> list:
    """One 4-rank run per file, shared by the checks (a stub's error is shared too)."""
    return [r[impl] for r in launched_once("minizero.autograde.lab11:measure_worker", 4, {"impls": [impl]}, 180)]


# ------------------------------------------------------------------------------ the judges
def judge_block(results) -> str:
    r = first_phase(results, "block")[0]  # the same data on every rank
    for key, m in r.items():
        scale, causal = key.split("/")
        where = (f"block_attention({'causal' if causal == 'True' else 'not causal'}, scores ~ "
                 f"{'1e3' if scale != '1' else '1'})")
        if m["lse_shape"] != m["o_shape"][:-1]:
            raise CheckFailed(f"{where}: L_B has shape {m['lse_shape']}, expected {m['o_shape'][:-1]} = [b, heads, "
                              "s_q]: one log-sum-exp per query row, no trailing dimension (no keepdim)")
        if m["lse"] > ATOL:
            if scale != "1" and r[f"1/{causal}"]["lse"] <= ATOL:
                raise CheckFailed(f"{where}: L_B is not finite or wrong for large scores (error {m['lse']:.3g}) but "
                                  "right for small ones: exp(s) overflows float32 above s ~ 88. Subtract the row max "
                                  "before exp and add it back (log-sum-exp is stable that way), or use torch.logsumexp")
            raise CheckFailed(f"{where}: L_B differs from torch.logsumexp(s, -1) by {m['lse']:.3g}: L_B = log sum_j "
                              "exp(s_j) over the block's keys (dim -1)")
        if m["o"] > ATOL:
            if m["o_unnormalized"] <= ATOL:
                why = "it is exp(s) @ v, not normalized: divide by the denominator, i.e. use exp(s - L_B)"
            elif m["o_wrong_dim"] <= ATOL:
                why = "the softmax was taken over the queries (dim -2) instead of the keys (dim -1)"
            else:
                why = "o_B = exp(s - L_B) @ v"
            raise CheckFailed(f"{where}: o_B differs from softmax attention by {m['o']:.3g}: {why}")
    return (f"o_B and L_B equal softmax attention and torch.logsumexp within {ATOL:g}, causal and not, at scores ~1 "
            "and ~1e3")


def judge_merge(results) -> str:
    r = first_phase(results, "merge")[0]
    for scale, m in r.items():
        where = f"merge (scores ~ {'1' if scale == '1' else '1e3'})"
        if m["in_place"]:
            raise CheckFailed(f"{where} changed its `out` argument in place: the caller may still use it (the ring "
                              "keeps no copy); build and return a new tensor")
        if m["lse_shape"] != [1, 2, 6]:
            raise CheckFailed(f"{where}: the merged L has shape {m['lse_shape']}, expected [1, 2, 6] = [b, heads, s_q]")
        if m["two_lse"] > ATOL:
            if scale != "1" and r["1"]["two_lse"] <= ATOL:
                why = "exp(L) overflows float32 for large L: use torch.logaddexp (it subtracts the max)"
            elif m["two_lse_is_max"] <= ATOL:
                why = "it is max(L_1, L_2): the denominators ADD, L = log(exp(L_1) + exp(L_2)) (torch.logaddexp)"
            elif m["two_lse_is_sum"] <= ATOL:
                why = "it is L_1 + L_2: log-sum-exps of disjoint key blocks combine as log(exp(L_1) + exp(L_2)), not +"
            else:
                why = "L = log(exp(L_1) + exp(L_2))"
            raise CheckFailed(f"{where}: the merged log-sum-exp differs from logaddexp(L_1, L_2) by "
                              f"{m['two_lse']:.3g}: {why}")
        if m["two_o"] > ATOL:
            if scale != "1" and r["1"]["two_o"] <= ATOL:
                why = ("not finite for large L: exp(L_1) and exp(L_2) overflow float32; weight with exp(L_i - L), "
                       "which is at most 1")
            elif m["two_o_is_sum"] <= ATOL or m["two_o_is_mean"] <= ATOL:
                why = ("the outputs were " + ("added" if m["two_o_is_sum"] <= ATOL else "averaged") + " without the "
                       "weights exp(L_i - L): each o_i is normalized by its own block's denominator and must be "
                       "rescaled by its share of the whole one")
            elif m["two_o_swapped"] <= ATOL:
                why = "the weights are swapped: o_1 is weighted by exp(L_1 - L) and o_B by exp(L_B - L)"
            else:
                why = "o = exp(L_1 - L) o_1 + exp(L_B - L) o_B"
            raise CheckFailed(f"{where}: the merged output differs by {m['two_o']:.3g}: {why}")
        for order in ("forward", "reverse"):
            if m[order]["o"] > ATOL or m[order]["lse"] > ATOL:
                raise CheckFailed(f"{where}: 3 blocks merged in {order} order differ from attention over all keys "
                                  f"(o by {m[order]['o']:.3g}, L by {m[order]['lse']:.3g})")
    return ("two blocks merge to logaddexp and exp(L_i - L)-weighted outputs; 3 blocks in two orders equal whole "
            "attention")


def judge_ring(results) -> str:
    for rank, r in enumerate(first_phase(results, "ring")):
        for case, diffs in r.items():
            bad = {k: v for k, v in diffs.items() if not v <= ATOL}
            if bad:
                worst = max(bad, key=lambda k: bad[k])
                raise CheckFailed(f"ring attention (cp={len(results)}, {case}) with your block_attention and merge: "
                                  f"rank {rank}'s {worst} differs from torch's scaled_dot_product_attention by "
                                  f"{bad[worst]:.3g} (out, dq, dk, dv: "
                                  f"{', '.join(f'{v:.2g}' for v in diffs.values())})")
    return (f"ring attention at cp={len(results)}, causal balanced and full: output and gradients within {ATOL:g} of "
            "torch's")


CHECKS = [
    Check("block_attention: o_B and L_B of one block, causal and not, stable at large scores", 3,
          judged_check(judge_block, measured)),
    Check("merge: the online-softmax rescaling, any order, stable, not in place", 4,
          judged_check(judge_merge, measured)),
    Check("ring attention (cp=4) with your kernels equals torch's attention, output and gradients", 3,
          judged_check(judge_ring, measured)),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab11_ring_attention.py` shows."""
    from minizero.experiments.context import attention_side_by_side
    for causal in (True, False):
        res = attention_side_by_side(comm, "ring", causal, causal, kernels=impl)
        if comm.rank == 0:
            print(f"\nring attention, cp={comm.size}, {'causal, load-balanced' if causal else 'not causal'}: largest "
                  f"difference from torch's attention: "
                  + ", ".join(f"{k} {v:.2g}" for k, v in res["max_diff"].items()))
            print(f"  bytes sent per rank: forward {res['sent']['forward']}, backward {res['sent']['backward']}; "
                  f"formula {res['formula']['forward']} and {res['formula']['backward']}")
