"""Lab 11 checks: your block attention and online-softmax merge (minizero/context/online_softmax.py)
against torch's scaled_dot_product_attention and torch.logsumexp, your ring loop (which chunk pairs
are computed, who sends which block to whom and when: layout.pair_kind, ring_attention's exchange
and forward loop), then your ring attention whole.

Each check launches a 4-rank job (`measure_worker`) that runs only the phases it grades
(`judge_*` judges them): a stub or a crash in one task (a transfer never waited for, in the real
ring) fails only the checks that need that task, with their own messages, and the others keep
their points. The grader's shared jobs (grader.batch) put many such launches in one job. Phases:
  block   block_attention on one block, causal (diagonal) and not, at ordinary and at large scores
          (|s| ~ 1e3, where exp(s) overflows float32): o_B and L_B against softmax and logsumexp;
          once in bfloat16: o_B must come back in v's dtype and L_B stay float32
  merge   keys cut into 3 blocks, blocks from the REFERENCE block_attention folded with your merge
          in two orders: (o, L) against attention over all keys; the diagnostic candidates of the
          usual slips (max instead of logaddexp, no weights, swapped weights); whether `out` changed;
          once in bfloat16: the merged o in the blocks' dtype, L float32
  loop    your pair_kind on every chunk pair; your ring forward run against a ring of cp=4 ranks
          SIMULATED in this process (no message sent; a receive is filled when waited for, with what
          a correct neighbour sends): the transfers posted and waited for and every block computed,
          in order, causal load-balanced and full
  ring    your ring_attention with your kernels at cp=4 over the real ranks, causal load-balanced and
          full: output and dq, dk, dv gathered against torch's attention (minizero_course.experiments.context);
          not run when the loop phase saw transfers that do not pair up (they would never complete)
A phase that raises in your code is recorded (with the error) and the next phase runs; the loop and
ring phases also record a TODO left (so the first two checks grade without them).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minizero_course.grader import Check, CheckFailed, Lab, first_phase, judged_check, launched_once
from minizero_course.grader.lab10 import _phase, _phase_or_todo, load
from minizero.context import online_softmax as reference
from minizero.context.layout import chunks_of, pair_kind

LAB = Lab(11, "ring_attention", "Ring attention: block attention, the online-softmax merge and the ring loop",
          ("minizero/context/online_softmax.py", "minizero/context/layout.py", "minizero/context/ring_attention.py"))

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
    out = {"bf16": _bf16_block(mod)}
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
    out = {"bf16": _bf16_merge(mod)}
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


BF16_ATOL = 2e-2  # o_B in bfloat16 (8 bits of mantissa: a few ulps of values ~1)
LSE_ATOL = 1e-4   # L_B kept in float32 from the float32 scores; in bfloat16 it is off by ~1e-2


def _bf16_block(mod):
    """block_attention on bfloat16 q, k, v: dtypes, and values against the float32 math on the same scores."""
    q, k, v = (_data(20 + i, 1, 2, 6, 4).bfloat16() for i in range(3))
    o, lse = mod.block_attention(q, k, v, causal=True)
    scores = _scores(q, k, True).float()  # q @ k^T in bfloat16, as the given code computes it, then float32
    want_lse = torch.logsumexp(scores, -1)
    return {"o_dtype": str(o.dtype).removeprefix("torch."), "lse_dtype": str(lse.dtype).removeprefix("torch."),
            "o": _diff(o, torch.softmax(scores, -1) @ v.float()), "lse": _diff(lse, want_lse)}


def _bf16_merge(mod):
    q, k, v = (_data(30 + i, 1, 2, 6 if i == 0 else 12, 4).bfloat16() for i in range(3))
    (o1, l1), (o2, l2) = (reference.block_attention(q, kb, vb) for kb, vb in zip(k.chunk(2, -2), v.chunk(2, -2)))
    o, lse = mod.merge(o1, l1, o2, l2)
    return {"o_dtype": str(o.dtype).removeprefix("torch."), "lse_dtype": str(lse.dtype).removeprefix("torch."),
            "lse": _diff(lse, torch.logaddexp(l1, l2))}


# ------------------------------------------------------------------------------ the simulated ring
SIM_CP, SIM_SEQ = 4, 16  # 8 chunks of 2 tokens when balanced


class _Handle:
    def __init__(self, log, kind, fill=None):
        self.log, self.kind, self.fill, self.done = log, kind, fill, False

    def wait(self):
        if not self.done:
            self.done = True
            self.log.append({"event": "wait", "what": self.kind})
            if self.fill is not None:
                self.fill()


class _SimComm:
    """Rank `rank` of a ring of `size` ranks simulated in this process: sends are logged, not sent; the
    n-th receive from rank src is filled, when waited for, with the block src holds at step n of a correct
    ring ((src - n) mod size's: each block travels r -> r+1)."""

    def __init__(self, rank, size, kv, log, chunks):
        self.rank, self.size, self.kv, self.log, self.chunks, self.received = rank, size, kv, log, chunks, 0

    def isend(self, tensor, dst, tag=0):
        self.log.append({"event": "send", "peer": int(dst), "block": _owner(tensor, self.kv)})
        return _Handle(self.log, "send")

    def irecv(self, buffer, src, tag=0):
        content = self.kv[(src - self.received) % self.size]
        self.received += 1
        self.log.append({"event": "recv", "peer": int(src)})
        return _Handle(self.log, "recv", lambda: buffer.copy_(content) if buffer.shape == content.shape else None)


def _owner(t, kv) -> int:
    """Whose stacked k/v block `t` is (-1: nobody's)."""
    return next((r for r, block in enumerate(kv) if block.shape == t.shape and torch.equal(block, t)), -1)


class _Recorder:
    """The reference kernels, logging which query chunk met which key chunk, and how (-1: no chunk's data)."""

    def __init__(self, log, q_chunks, k_chunks):
        self.log, self.q_chunks, self.k_chunks = log, q_chunks, k_chunks

    def block_attention(self, q, k, v, causal=False):
        index = [next((i for i, c in enumerate(chunks) if c.shape == t.shape and torch.equal(c, t)), -1)
                 for t, chunks in ((q, self.q_chunks), (k, self.k_chunks))]
        self.log.append({"event": "compute", "q": index[0], "k": index[1], "causal": bool(causal)})
        return reference.block_attention(q, k, v, causal=causal)

    def merge(self, *partials):
        return reference.merge(*partials)


def _simulated_forward(mod, causal: bool) -> list:
    """Each simulated rank's log and the largest difference of its output from torch's attention."""
    from minizero.context.layout import shard_sequence
    cp, balanced = SIM_CP, causal
    q, k, v = (_data(40 + i, 1, 2, SIM_SEQ, 4) for i in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    parts = 2 * cp if balanced else cp
    q_chunks, k_chunks = q.chunk(parts, -2), k.chunk(parts, -2)
    kv = [torch.stack([shard_sequence(t, r, cp, balanced) for t in (k, v)]).contiguous() for r in range(cp)]
    runs = []
    for rank in range(cp):
        log: list = []
        try:
            out = mod.ring_attention(shard_sequence(q, rank, cp, balanced), kv[rank][0].clone(), kv[rank][1].clone(),
                                     _SimComm(rank, cp, kv, log, k_chunks), causal=causal, balanced=balanced,
                                     kernels=_Recorder(log, q_chunks, k_chunks))
            runs.append({"log": log, "out": _diff(out, shard_sequence(want, rank, cp, balanced))})
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - the student's loop may raise on the simulated ring
            runs.append({"log": log, "error": f"{type(e).__name__}: {e}"})
    return runs


def loop_phase(mod):
    kinds = {f"{a},{b},{c}": mod.pair_kind(a, b, c) for a in range(4) for b in range(4) for c in (True, False)}
    return {"pair_kind": kinds, "causal, balanced": _simulated_forward(mod, True),
            "full": _simulated_forward(mod, False)}


def _pairs_up(loop) -> bool:
    """Whether the simulated transfers pair up around a ring (else the real ring's receives never complete)."""
    if not isinstance(loop, dict) or "error" in loop:
        return False
    for case in ("causal, balanced", "full"):
        for rank, run in enumerate(loop[case]):
            peers = ({(e["event"], e["peer"]) for e in run["log"] if e["event"] in ("send", "recv")})
            if not peers <= {("send", (rank + 1) % SIM_CP), ("recv", (rank - 1) % SIM_CP)} and \
                    not peers <= {("send", (rank - 1) % SIM_CP), ("recv", (rank + 1) % SIM_CP)}:
                return False
    return True


def ring_phase(comm, mod):
    from minizero_course.experiments.context import attention_side_by_side
    return {f"{'causal, balanced' if causal else 'full'}": attention_side_by_side(
        comm, "ring", causal, causal, kernels=mod, ring=mod.ring_attention)["max_diff"] for causal in (True, False)}


PHASES = ("block", "merge", "loop", "ring")


def measure_worker(comm, impls: list[str], phases=PHASES) -> dict:
    """{impl: {phase: result}} for each file."""
    torch.set_num_threads(1)
    out = {}
    for impl in impls:
        mod = _phase(comm, lambda: load(impl))
        if isinstance(mod, dict):
            out[impl] = {p: mod for p in PHASES}
            continue
        res = {name: _phase(comm, fn) for name, fn in (("block", lambda: block_phase(mod)),
                                                       ("merge", lambda: merge_phase(mod))) if name in phases}
        if "loop" in phases or "ring" in phases:
            res["loop"] = _phase_or_todo(comm, lambda: loop_phase(mod))
        if "ring" in phases:
            res["ring"] = (_phase_or_todo(comm, lambda: ring_phase(comm, mod)) if _pairs_up(res["loop"]) else
                           {"error": "not run: your ring's transfers do not pair up (the ring loop check says how), "
                                     "so its receives would never complete"})
        out[impl] = res
    return out


def measured(impl: str, phases: tuple) -> list:
    """One 4-rank run per file and set of phases: a check's run holds only the tasks it grades."""
    return [r[impl] for r in launched_once("minizero_course.grader.lab11:measure_worker", 4,
                                           {"impls": [impl], "phases": list(phases)}, 180)]


# ------------------------------------------------------------------------------ the judges
def judge_block(results) -> str:
    r = dict(first_phase(results, "block")[0])  # the same data on every rank
    bf16 = r.pop("bf16")
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
    where = "block_attention(bfloat16 q, k, v)"
    if bf16["lse_dtype"] != "float32":
        raise CheckFailed(f"{where}: L_B is {bf16['lse_dtype']}: keep the log-sum-exp in float32 (score_dtype) "
                          "whatever the inputs: the merge weights by exp(L_i - L), and bfloat16 rounds a log-sum-exp "
                          "near 10 to a multiple of 1/16: every weight off by up to 3%")
    if bf16["o_dtype"] != "bfloat16":
        raise CheckFailed(f"{where}: o_B is {bf16['o_dtype']}, v is bfloat16: return o_B in v's dtype (cast the "
                          "probabilities to v.dtype before @ v), or the activations a bf16 model keeps for backward "
                          "double in size")
    if bf16["lse"] > LSE_ATOL:
        raise CheckFailed(f"{where}: L_B differs by {bf16['lse']:.3g} from logsumexp of the float32 scores: it went "
                          "through a 16-bit dtype on the way; compute it from the float32 scores and keep it float32")
    if bf16["o"] > BF16_ATOL:
        raise CheckFailed(f"{where}: o_B differs from softmax attention by {bf16['o']:.3g} (bfloat16 allows "
                          f"{BF16_ATOL:g})")
    return (f"o_B and L_B equal softmax attention and torch.logsumexp within {ATOL:g}, causal and not, at scores ~1 "
            "and ~1e3; in bfloat16, o_B bfloat16 and L_B float32")


def judge_merge(results) -> str:
    r = dict(first_phase(results, "merge")[0])
    bf16 = r.pop("bf16")
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
    where = "merge of two bfloat16 blocks (o_B bfloat16, L_B float32)"
    if bf16["lse_dtype"] != "float32" or bf16["lse"] > LSE_ATOL:
        raise CheckFailed(f"{where}: the merged L is {bf16['lse_dtype']}, off by {bf16['lse']:.3g}: the log-sum-exp "
                          "stays float32 (it weights every later merge); do not cast it to the outputs' dtype")
    if bf16["o_dtype"] != "bfloat16":
        raise CheckFailed(f"{where}: the merged output is {bf16['o_dtype']}: the float32 weights exp(L_i - L) promote "
                          "it; cast the result back to the blocks' dtype (block_out.dtype)")
    return ("two blocks merge to logaddexp and exp(L_i - L)-weighted outputs; 3 blocks in two orders equal whole "
            "attention; bfloat16 blocks merge to a bfloat16 o and a float32 L")


def _expected_pairs(rank, source_at, owner_at, causal):
    """Sorted (query chunk, key chunk, masked) of every block computed in the forward, when at step i the pairs
    come from _pairs(rank, source_at(i)) and the keys held are owner_at(i)'s (the right loop: both r - i)."""
    out = []
    for step in range(SIM_CP):
        held = chunks_of(owner_at(step), SIM_CP, causal)  # balanced exactly when causal
        for a in chunks_of(rank, SIM_CP, causal):
            for ki, b in enumerate(chunks_of(source_at(step), SIM_CP, causal)):
                kind = pair_kind(a, b, causal)
                if kind != "skip":
                    out.append((a, held[ki], kind == "diagonal"))
    return sorted(out)


def _judge_pair_kind(kinds: dict):
    for key, got in kinds.items():
        a, b, causal = int(key.split(",")[0]), int(key.split(",")[1]), key.endswith("True")
        want = pair_kind(a, b, causal)
        if got == want:
            continue
        if not causal:
            why = "without the causal mask every query sees every key: every pair is 'full'"
        elif a == b:
            why = ("query and key chunk are the same tokens: query i sees keys 0..i of it, so the mask cuts the block "
                   "('diagonal')")
        elif b < a:
            why = (f"key chunk {b} is wholly in the PAST of query chunk {a}: every query sees all of it ('full'); "
                   "only later key chunks are skipped")
        else:
            why = f"key chunk {b} is wholly in the FUTURE of query chunk {a}: no query sees it ('skip': not computed)"
        raise CheckFailed(f"layout.pair_kind({a}, {b}, causal={causal}) returned {got!r}, expected {want!r}: {why}")


def _wrong_blocks(rank, got, want, causal) -> str:
    """Why the blocks computed (got) are not the ring's (want): the usual slips first."""
    cp = SIM_CP
    if got == _expected_pairs(rank, lambda i: (rank + i) % cp, lambda i: (rank - i) % cp, causal):
        return ("the pairs came from _pairs(rank, (rank + step) % cp, ...): after `step` hops r -> r+1 this rank holds "
                "the block of rank (rank - step) mod cp")
    extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    future = [(a, b) for a, b, _ in extra if pair_kind(a, b, causal) == "skip"]
    if future:
        return (f"it computed query chunk {future[0][0]} against key chunk {future[0][1]}, wholly in the future: a "
                "'skip' pair is not computed at all (no scores, no mask)")
    flipped = [(a, b) for a, b, masked in extra if (a, b, not masked) in missing]
    if flipped:
        a, b = flipped[0]
        return (f"it computed chunk pair ({a}, {b}) with causal={a != b}: only a 'diagonal' pair is masked "
                "(block_attention(..., causal=True)), a 'full' one is not")
    if missing:
        return f"it never computed query chunk {missing[0][0]} against key chunk {missing[0][1]}"
    return "some blocks were computed more than once"


def _judge_run(case, rank, run, causal):
    """One simulated rank's forward: the first thing wrong, in the order a reader would fix it."""
    cp, where = SIM_CP, f"ring forward ({case}, rank {rank} of a simulated cp={SIM_CP} ring)"
    if "error" in run:
        raise CheckFailed(f"{where} raised {run['error']}")
    log = run["log"]
    sends = [i for i, e in enumerate(log) if e["event"] == "send"]
    recvs = [i for i, e in enumerate(log) if e["event"] == "recv"]
    waits = [i for i, e in enumerate(log) if e["event"] == "wait" and e["what"] == "recv"]
    computes = [e for e in log if e["event"] == "compute"]
    right, left = (rank + 1) % cp, (rank - 1) % cp
    for i in sends:
        if log[i]["peer"] != right:
            raise CheckFailed(f"{where}: exchange sent the block to rank {log[i]['peer']}: blocks travel r -> r+1 "
                              f"(mod cp), here {rank} -> {right}, the way the backward passes its gradient "
                              "accumulators")
    for i in recvs:
        if log[i]["peer"] != left:
            raise CheckFailed(f"{where}: exchange received from rank {log[i]['peer']}: the block comes from the rank "
                              f"before, r-1 (mod cp), here {left}, the one that sends to this rank")
    if len(sends) != cp - 1 or len(recvs) != cp - 1:
        raise CheckFailed(f"{where}: posted {len(sends)} sends and {len(recvs)} receives in cp = {cp} steps: cp - 1 "
                          "hops bring every block to every rank (one transfer posted per step but the last)")
    if len(waits) < len(recvs):
        raise CheckFailed(f"{where}: waited for {len(waits)} of {len(recvs)} receives: a received block may be read "
                          "only after ring.wait(pending) (until then its buffer is not filled)")
    if any(e["k"] < 0 or e["q"] < 0 for e in computes):
        raise CheckFailed(f"{where}: attended to a key block that is no rank's keys: a receive buffer read before "
                          "its transfer completed (read it after ring.wait)")
    if computes and all(e["k"] in chunks_of(rank, cp, causal) for e in computes):
        raise CheckFailed(f"{where}: attended to its own key block at every step: after ring.wait the received "
                          "block is the one this rank holds next (blocks = incoming)")
    got = sorted((e["q"], e["k"], e["causal"]) for e in computes)
    want = _expected_pairs(rank, lambda i: (rank - i) % cp, lambda i: (rank - i) % cp, causal)
    if got != want:
        raise CheckFailed(f"{where}: the blocks computed are not the ring's (query chunk, key chunk, masked) pairs: "
                          + _wrong_blocks(rank, got, want, causal))
    owner = {b: r for r in range(cp) for b in chunks_of(r, cp, causal)}
    at = {i: [n for n, e in enumerate(log) if e["event"] == "compute" and owner[e["k"]] == (rank - i) % cp]
          for i in range(cp)}
    for step in range(cp - 1):
        if sends[step] > at[step][0]:
            raise CheckFailed(f"{where}: step {step}'s transfer was posted after its block's compute began: post it "
                              "(ring.exchange) BEFORE computing, so the next block travels while this one computes")
        if waits[step] < at[step][-1]:
            raise CheckFailed(f"{where}: at step {step} the rank waited for the next block before computing the one "
                              "it holds: nothing is left to hide the transfer behind; wait after the compute")
    if run["out"] > ATOL:
        raise CheckFailed(f"{where}: the right blocks were computed in order, but the output differs from torch's "
                          f"attention by {run['out']:.3g}: fold each block into outs[qi], lses[qi] with kernels.merge")


def judge_ring_loop(results) -> str:
    r = first_phase(results, "loop")[0]
    _judge_pair_kind(r["pair_kind"])
    for case, causal in (("causal, balanced", True), ("full", False)):
        for rank, run in enumerate(r[case]):
            _judge_run(case, rank, run, causal)
    return (f"pair_kind right on every pair; on a simulated cp={SIM_CP} ring every rank sends to r+1, receives from "
            "r-1, posts each transfer before the compute it hides behind and waits after it, and computes exactly "
            "the ring's blocks (the future skipped, the diagonal masked), causal balanced and full")


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
    Check("block_attention: o_B and L_B of one block, causal and not, stable at large scores, dtypes kept", 2,
          judged_check(judge_block, measured, ("block",))),
    Check("merge: the online-softmax rescaling, any order, stable, not in place, dtypes kept", 3,
          judged_check(judge_merge, measured, ("merge",))),
    Check("the ring loop: pair_kind, who sends which block to whom and when, which blocks are computed", 3,
          judged_check(judge_ring_loop, measured, ("loop",))),
    # the loop phase first: a ring whose transfers do not pair up is not run on the real ranks
    Check("ring attention (cp=4), your loop and kernels, equals torch's attention, output and gradients", 2,
          judged_check(judge_ring, measured, ("loop", "ring"))),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab11_ring_attention.py` shows."""
    from minizero_course.experiments.context import attention_side_by_side
    for causal in (True, False):
        res = attention_side_by_side(comm, "ring", causal, causal, kernels=impl, ring=impl.ring_attention)
        if comm.rank == 0:
            print(f"\nring attention, cp={comm.size}, {'causal, load-balanced' if causal else 'not causal'}: largest "
                  f"difference from torch's attention: "
                  + ", ".join(f"{k} {v:.2g}" for k, v in res["max_diff"].items()))
            print(f"  bytes sent per rank: forward {res['sent']['forward']}, backward {res['sent']['backward']}; "
                  f"formula {res['formula']['forward']} and {res['formula']['backward']}")
