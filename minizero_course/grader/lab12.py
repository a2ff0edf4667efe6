"""Lab 12 checks: your MoE slots, all-to-all, dispatch, exchanges and combine (minizero/moe/dispatch.py)
against by-hand references, then inside the MoE layer against the single-process MoE.

ONE 4-rank job measures everything (`measure_worker`); each check judges its part (`judge_*`), so the
grader launches once per submission and the mutation suite (tests/mutants/lab12.py) grades all its
mutants in one job too. Phases, one after the other on every rank:
  positions  expert_positions on hand-made choices (top-1 and top-2) against slots filled one by
             one; the torch ops it dispatches and the lines of the lab file it runs, T and 4T tokens
  alltoall   AllToAll on rank-dependent blocks: forward and backward values, collectives per pass;
             bfloat16 blocks: the output's dtype and the bytes each pass sends
  local      dispatch and combine on hand-made routing (drops included): buffer, output, gradients;
             dispatch of float64 and bfloat16 tokens, combine of bfloat16 outputs: in that dtype
  exchange   exchange_to_experts / exchange_from_experts at ep = 4 and ep = 2 on labelled slots
  layer      the MoE model (experiments.experts.side_by_side with your functions): ep 4 top-1 with a
             skewed router (drops), ep 2 x expert-dp 2 top-2; 2 SGD steps each
A phase that raises in your code is recorded (with the error) and the next phase runs.
"""
from __future__ import annotations

import torch

from minizero_course.grader import Check, CheckFailed, Lab, first_phase, judged_check, launched_once
from minizero_course.grader.lab10 import _ops, measure_phases

LAB = Lab(12, "moe_dispatch", "MoE dispatch and combine with all-to-all", "minizero/moe/dispatch.py")

DTYPES = ("float16", "bfloat16", "float32", "float64")
ATOL = 2e-7  # at rtol 1e-6: only the order of float32 additions differs from one process
LAYER_STEPS = 2
POSITION_CASES = {  # name: (choices [T, k], E, C)
    "top-1": ([[0], [1], [0], [0], [2], [1], [0], [3], [1], [1]], 4, 2),
    "top-2": ([[0, 1], [0, 2], [1, 0], [0, 1], [2, 0], [1, 2]], 3, 3),
}


def slots_by_hand(choices: list, num_experts: int, capacity: int, choice_major=True):
    """Slots filled one by one: every first choice (token order), then every second choice."""
    filled, tokens, k = [0] * num_experts, len(choices), len(choices[0])
    slots = [[0] * k for _ in range(tokens)]
    order = [(t, j) for j in range(k) for t in range(tokens)] if choice_major else \
        [(t, j) for t in range(tokens) for j in range(k)]
    for t, j in order:
        slots[t][j] = filled[choices[t][j]]
        filled[choices[t][j]] += 1
    return slots, [[s < capacity for s in row] for row in slots]


COST_TOKENS = (64, 256)  # T and 4T: a vectorised expert_positions does the same work for both


# ------------------------------------------------------------------------------ the phases
def positions_phase(comm, mod):
    out = {}
    for name, (choices, num_experts, cap) in POSITION_CASES.items():
        slots, kept = mod.expert_positions(torch.tensor(choices), num_experts, cap)
        out[name] = {"slots": slots.tolist(), "kept": kept.tolist()}
    gen, out["cost"] = torch.Generator().manual_seed(5), []
    for tokens in COST_TOKENS:
        choices = torch.randint(0, 4, (tokens, 2), generator=gen)
        count = _cost(mod, lambda: mod.expert_positions(choices, 4, tokens // 2))
        out["cost"].append([tokens, *count])
    return out


def _cost(mod, fn) -> tuple[int, int]:
    """(torch ops dispatched, lines of the lab file run) by fn(): counts, not seconds, so that a
    busy machine cannot change the verdict. A Python loop over the tokens makes one or the other
    grow with T: over tensor elements it dispatches ops per token, over a list it runs lines."""
    import sys
    from torch.utils._python_dispatch import TorchDispatchMode
    counts = {"ops": 0, "lines": 0}

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["ops"] += 1
            return func(*args, **(kwargs or {}))

    def line(frame, event, arg):
        counts["lines"] += event == "line"
        return line

    before = sys.gettrace()
    mine = mod.__file__
    sys.settrace(lambda frame, event, arg: line if frame.f_code.co_filename == mine else None)
    try:
        with Ops():
            fn()
    finally:
        sys.settrace(before)
    return counts["ops"], counts["lines"]


def _blocks(seed, rank, size, rows=2, width=3):
    return torch.randn(size * rows, width, generator=torch.Generator().manual_seed(seed + rank))


def alltoall_phase(comm, mod):
    from minizero_course.experiments.tensor import atol_needed, collective_calls
    size, rank = comm.size, comm.rank
    x = _blocks(10, rank, size).requires_grad_()
    dy = _blocks(20, rank, size)
    comm.stats.reset()
    y = mod.AllToAll.apply(x, comm)
    forward = collective_calls(comm)
    comm.stats.reset()
    y.backward(dy)
    backward = collective_calls(comm)
    # block j of y = rank j's block `rank`; block j of x.grad = rank j's dy block `rank`
    want_y = torch.cat([_blocks(10, j, size).chunk(size)[rank] for j in range(size)])
    want_dx = torch.cat([_blocks(20, j, size).chunk(size)[rank] for j in range(size)])
    return {"forward": forward, "backward": backward, "y": atol_needed(y.detach(), want_y),
            "y_is_x": bool(torch.equal(y.detach(), x.detach())), "dx": atol_needed(x.grad, want_dx),
            "dx_is_dy": bool(torch.equal(x.grad, dy)), "bf16": _alltoall_bf16(comm, mod)}


def _alltoall_bf16(comm, mod) -> dict:
    """AllToAll of bfloat16 blocks: the output's dtype and each pass's payload bytes (2 per
    element), or the error it raised (on every rank alike: the same code meets the same dtypes)."""
    x = _blocks(10, comm.rank, comm.size).to(torch.bfloat16).requires_grad_()
    try:
        comm.stats.reset()
        y = mod.AllToAll.apply(x, comm)
        forward = comm.stats.as_dict().get("all_to_all", {}).get("payload_bytes", 0)
        comm.stats.reset()
        y.backward(_blocks(20, comm.rank, comm.size).to(torch.bfloat16))
        backward = comm.stats.as_dict().get("all_to_all", {}).get("payload_bytes", 0)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - all_to_all refuses two dtypes: that is the finding
        return {"raised": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    return {"y": str(y.dtype).removeprefix("torch."), "forward": forward, "backward": backward,
            "want": x.numel() * x.element_size()}


# hand-made routing: 6 tokens, E = 3, C = 2, top-2: 6 choices dropped (token 4 loses both), and each dropped
# choice's e*C + slot still lies inside the buffer (a later expert's slot), so writing it anyway does not raise
LOCAL_CHOICES = [[0, 1], [0, 2], [1, 0], [2, 0], [0, 1], [1, 0]]


def _row_errors(mine: torch.Tensor, ref: torch.Tensor) -> list[float]:
    from minizero_course.experiments.tensor import atol_needed
    return [atol_needed(m, r) for m, r in zip(mine.reshape(len(mine), -1), ref.reshape(len(ref), -1))]


def local_phase(comm, mod):
    from minizero_course.experiments.tensor import atol_needed
    gen = torch.Generator().manual_seed(3)
    num_experts, cap, hidden = 3, 2, 4
    choice = torch.tensor(LOCAL_CHOICES)
    tokens_n, k = choice.shape
    slots, kept = (torch.tensor(v) for v in slots_by_hand(LOCAL_CHOICES, num_experts, cap))
    tokens = torch.randn(tokens_n, hidden, generator=gen).requires_grad_()
    weights = torch.arange(1.0, num_experts * cap * hidden + 1).view(num_experts, cap, hidden)
    want_buf, want_dtok = torch.zeros(num_experts, cap, hidden), torch.zeros(tokens_n, hidden)
    for t in range(tokens_n):
        for j in range(k):
            if kept[t, j]:
                want_buf[choice[t, j], slots[t, j]] += tokens[t].detach()
                want_dtok[t] += weights[choice[t, j], slots[t, j]]
    buf = mod.dispatch(tokens, choice, slots, kept, num_experts, cap)
    (buf * weights).sum().backward()
    dropped_slots = {(choice[t, j].item() * cap + slots[t, j].item()) for t in range(tokens_n) for j in range(k)
                     if not kept[t, j]}
    slot_errors = _row_errors(buf.detach().reshape(-1, hidden), want_buf.reshape(-1, hidden))
    out = {"buffer": max(slot_errors), "wrong_slots": [i for i, e in enumerate(slot_errors) if e > ATOL],
           "dropped_slots": sorted(dropped_slots), "dtokens": atol_needed(tokens.grad, want_dtok)}
    gates = torch.rand(choice.shape, generator=gen).add_(0.1).requires_grad_()  # nonzero for dropped choices too
    expert_out = torch.randn(num_experts, cap, hidden, generator=gen).requires_grad_()
    y = mod.combine(expert_out, choice, slots, kept, gates)
    zero = torch.zeros(hidden)
    want_y = torch.stack([sum((gates[t, j] * expert_out[choice[t, j], slots[t, j]] for j in range(k) if kept[t, j]),
                              zero) for t in range(tokens_n)])
    unweighted = torch.stack([sum((expert_out[choice[t, j], slots[t, j]] for j in range(k) if kept[t, j]), zero)
                              for t in range(tokens_n)])
    dy = torch.randn(want_y.shape, generator=gen)
    want_grads = torch.autograd.grad(want_y, (expert_out, gates), dy)
    grads = torch.autograd.grad(y, (expert_out, gates), dy, allow_unused=True)
    token_errors = _row_errors(y.detach(), want_y.detach())
    out.update({"combine": max(token_errors), "combine_unweighted": atol_needed(y.detach(), unweighted.detach()),
                "wrong_tokens": [t for t, e in enumerate(token_errors) if e > ATOL],
                "tokens_with_drops": [t for t in range(tokens_n) if not kept[t].all()],
                "combine_grads": max(float("inf") if g is None else atol_needed(g, w)
                                     for g, w in zip(grads, want_grads)),
                "dtypes": {str(dtype).removeprefix("torch."):
                           _dtype(mod.dispatch, tokens.detach().to(dtype), choice, slots, kept,
                                  num_experts, cap)
                           for dtype in (torch.float64, torch.bfloat16)},
                "combine_dtypes": {"bfloat16": _dtype(mod.combine, expert_out.detach().bfloat16(),
                                                      choice, slots, kept,
                                                      gates.detach().bfloat16())}})
    return out


def _dtype(fn, *args) -> str:
    """The dtype fn returns for these inputs, or the error it raised."""
    try:
        return str(fn(*args).dtype).removeprefix("torch.")
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - a buffer of another dtype makes index_add raise: that is the finding
        return f"raised {type(e).__name__}: {str(e).splitlines()[0]}"


def _label(rank, expert, slot):
    return 1000 * rank + 10 * expert + slot


def exchange_phase(comm, mod):
    from minizero.comm import Mesh
    out = {}
    num_experts, cap, hidden = 4, 2, 3
    for ep in (4, 2):
        group = Mesh(comm, ep=ep).ep
        me, local = group.rank, num_experts // ep
        x = torch.tensor([[[_label(me, e, c)] * hidden for c in range(cap)] for e in range(num_experts)],
                         dtype=torch.float32)
        received = torch.tensor([[[_label(j, me * local + i, c) for c in range(cap)] for i in range(local)]
                                 for j in range(ep)])                       # [ep (source), E/ep, C]
        got = mod.exchange_to_experts(x, group)
        back = mod.exchange_from_experts(got, group)
        out[f"ep{ep}"] = {"to": got[..., 0].long().tolist(),
                          "want_to": received.transpose(0, 1).reshape(local, -1).tolist(),
                          "no_transpose": received.reshape(local, -1).tolist(),
                          "back": back[..., 0].long().tolist(), "want_back": x[..., 0].long().tolist()}
    return out


def layer_phase(comm, mod):
    from minizero.comm import Mesh
    from minizero_course.experiments.experts import side_by_side
    return {"ep4/top-1/skewed": side_by_side(Mesh(comm, ep=4), k=1, capacity_factor=1.0, skew=1.0,
                                             steps=LAYER_STEPS, ops=mod),
            "ep2/top-2": side_by_side(Mesh(comm, ep=2), k=2, capacity_factor=1.0, steps=LAYER_STEPS, ops=mod)}


PHASES = {"positions": positions_phase, "alltoall": alltoall_phase, "local": local_phase,
          "exchange": exchange_phase, "layer": layer_phase}


UNITS = ("positions", "alltoall", "local", "exchange")  # the parts: one job (seconds); the layer: another


def measure_worker(comm, impls: list[str], phases=tuple(PHASES)) -> dict:
    """{impl: {phase: result}} for each file, for the phases asked."""
    return measure_phases(comm, impls, PHASES, phases)


def measured(impl: str, phases=UNITS) -> list:
    """One 4-rank run per file and phase set, shared by the checks (a stub's error is shared too): the four
    checks of the parts share one, the layer check has its own (so a mutant of a part never waits for it)."""
    results = launched_once("minizero_course.grader.lab12:measure_worker", 4, {"impls": [impl], "phases": list(phases)},
                            240)
    return [r[impl] for r in results]


# ------------------------------------------------------------------------------ the judges
def judge_positions(results) -> str:
    res = first_phase(results, "positions")[0]  # the same on every rank: no collective
    for name, (choices, num_experts, cap) in POSITION_CASES.items():
        slots, kept = slots_by_hand(choices, num_experts, cap)
        mine = res[name]
        if mine["slots"] != slots:
            shifted = [[s + 1 for s in row] for row in slots]
            token_major = slots_by_hand(choices, num_experts, cap, choice_major=False)[0]
            why = ("slots start at 1: an expert's first choice takes slot 0 (the running count includes the choice "
                   "itself: subtract 1)" if mine["slots"] == shifted else
                   "a token's second choice took its slot before later tokens' first choices: every first choice (in "
                   "token order) fills its slot before any second choice (lay the choices out choice-major, [k*T, E])"
                   if mine["slots"] == token_major else "the slot of a choice is how many earlier choices went to "
                   "the same expert (first choices first)")
            raise CheckFailed(f"{name} (choices {choices}, E={num_experts}): slots {mine['slots']}, expected {slots}: "
                              f"{why}")
        if mine["kept"] != kept:
            at_capacity = any(s == cap and m for row_s, row_m in zip(slots, mine["kept"]) for s, m in zip(row_s, row_m))
            why = (f"a choice in slot {cap} = C was kept: the slots are 0..C-1, kept = slot < capacity" if at_capacity
                   else "kept must be slot < capacity")
            raise CheckFailed(f"{name} (C={cap}): kept {mine['kept']}, expected {kept}: {why}")
    (small, ops, lines), (large, ops_4t, lines_4t) = res["cost"]
    if ops_4t > ops or lines_4t > lines:
        raise CheckFailed(
            f"expert_positions is right, but its work grows with the tokens: {ops} torch ops and "
            f"{lines} lines of your file run for T = {small}, {ops_4t} and {lines_4t} for "
            f"T = {large}: a Python loop over the tokens, whose time grows with T (1e4-1e5 tokens "
            "per rank). Compute every slot at once: one_hot, then cumsum over the choices laid out "
            "choice-major")
    return ("slots and kept equal slots filled one by one (first choices before second), top-1 "
            f"and top-2; the same {ops} torch ops for T = {small} and {large} (no loop over the "
            "tokens)")


def judge_alltoall(results) -> str:
    size = len(results)
    for rank, r in enumerate(first_phase(results, "alltoall")):
        if r["forward"] != {"all_to_all": 1}:
            raise CheckFailed(f"AllToAll's forward ran {_ops(r['forward'])}, expected 1 all_to_all: block j of the "
                              "input goes to rank j")
        if r["y"] > 0:
            why = ("it returned its input unchanged" if r["y_is_x"]
                   else f"block j of the output must be rank j's block {rank}")
            raise CheckFailed(f"rank {rank}: AllToAll's forward output is wrong: {why}")
        if r["backward"] != {"all_to_all": 1}:
            raise CheckFailed(f"AllToAll's backward ran {_ops(r['backward'])}, expected 1 all_to_all: block j of the "
                              "output came from rank j, so its gradient must go back to rank j (the gradient was not "
                              "sent back)" if not r["backward"] else f"AllToAll's backward ran {_ops(r['backward'])}, "
                              "expected 1 all_to_all of the gradient")
        if r["dx"] > 0:
            why = " (it returned the gradient as it came)" if r["dx_is_dy"] else ""
            raise CheckFailed(f"rank {rank}: AllToAll's backward gradient is wrong{why}: block j of the input gradient "
                              f"is rank j's output-gradient block {rank}")
        _judge_bf16(r["bf16"])
    return (f"AllToAll: 1 all-to-all forward, 1 backward, blocks to and from the right ranks (4 "
            f"ranks, {size} blocks); bfloat16 stays bfloat16, 2 bytes per element each way")


def _judge_bf16(b: dict):
    if "raised" in b:
        raise CheckFailed(f"AllToAll of bfloat16 blocks raised {b['raised']}: make the buffers in "
                          "the input's dtype (torch.empty_like), not torch's default float32")
    if b["y"] != "bfloat16" or b["forward"] != b["want"]:
        raise CheckFailed(f"AllToAll of bfloat16 blocks returned {b['y']} after sending "
                          f"{b['forward']} B (the blocks hold {b['want']} B): keep the input's "
                          "dtype (torch.empty_like(x), no cast): a bf16 model's all-to-all sends 2 "
                          "bytes per element, not 4")
    if b["backward"] != b["want"]:
        raise CheckFailed(f"AllToAll's backward sent {b['backward']} B for a bfloat16 gradient "
                          f"of {b['want']} B: send the gradient in its own dtype "
                          "(torch.empty_like(grad), no cast)")


def judge_local(results) -> str:
    r = first_phase(results, "local")[0]
    if r["buffer"] > 0:
        if r["wrong_slots"] and set(r["wrong_slots"]) <= set(r["dropped_slots"]):
            raise CheckFailed(f"dispatch: flat slots {r['wrong_slots']} hold a token whose choice was DROPPED (its "
                              "slot is >= C, so e*C + slot lands in the next expert's slots): write only the kept "
                              "choices")
        raise CheckFailed(f"dispatch: the [E, C, d] buffer is wrong in flat slots {r['wrong_slots']}: slot (e, c) "
                          "holds the token whose kept choice is expert e, slot c, zeros elsewhere")
    if r["dtokens"] > ATOL:
        raise CheckFailed(f"dispatch: the gradient reaching the tokens is wrong (excess {r['dtokens']:.3g}): build the "
                          "buffer with an out-of-place op autograd follows (index_add, not an in-place write into a "
                          "leaf)")
    if r["combine"] > ATOL:
        if r["combine_unweighted"] <= ATOL:
            raise CheckFailed("combine: the output is the plain sum of the chosen experts' outputs, not weighted by "
                              "the gates: y_t = sum_j gates[t, j] * expert_out[e_tj, c_tj]")
        if set(r["wrong_tokens"]) <= set(r["tokens_with_drops"]):
            raise CheckFailed(f"combine: tokens {r['wrong_tokens']} (the ones with a dropped choice) are wrong: a "
                              "dropped choice contributed to the output; only kept choices count "
                              "(weight the rest by 0)")
        raise CheckFailed(f"combine: tokens {r['wrong_tokens']} differ from sum_j gates * expert_out[e, c] over the "
                          "kept choices")
    if r["combine_grads"] > ATOL:
        raise CheckFailed(f"combine: the gradients of the expert outputs or of the gates are wrong (excess "
                          f"{r['combine_grads']:.3g})")
    for dtype, got in r["dtypes"].items():
        if got != dtype:
            raise CheckFailed(f"dispatch of {dtype} tokens {'returned ' + got if got in DTYPES else got}: the buffer "
                              "must be made in the tokens' dtype (and on their device), not the default float32: a "
                              "bf16 model's all-to-all then sends 2 bytes per element, not 4, and a float64 one "
                              "loses nothing")
    for dtype, got in r["combine_dtypes"].items():
        if got != dtype:
            got = "returned " + got if got in DTYPES else got
            raise CheckFailed(f"combine of {dtype} expert outputs and gates {got}: weight by "
                              "the bool kept mask as it is (or cast to the outputs' dtype), never "
                              ".float(): a float32 factor promotes the tokens, and the bf16 "
                              "model's next layer gets float32")
    return ("dispatch and combine equal the by-hand buffer and sum over the kept choices (with drops), gradients too; "
            "dispatch keeps the tokens' dtype (float64, bfloat16), combine bfloat16's")


def judge_exchange(results) -> str:
    for rank, r in enumerate(first_phase(results, "exchange")):
        for ep, x in r.items():
            if x["to"] != x["want_to"]:
                why = ("the local expert must come first: what arrives is [ep (source), E/ep, C, d]; transpose it to "
                       "[E/ep, ep, C, d] before merging the source and slot dims" if x["to"] == x["no_transpose"] else
                       "local expert i's rows must be every rank's slots of that expert, by source rank then slot")
                raise CheckFailed(f"{ep}: rank {rank}: exchange_to_experts gave rows labelled (1000*rank + 10*expert + "
                                  f"slot) {x['to']}, expected {x['want_to']}: {why}")
            if x["back"] != x["want_back"]:
                raise CheckFailed(f"{ep}: rank {rank}: exchange_from_experts(exchange_to_experts(x)) is not x: got "
                                  f"{x['back']}, expected {x['want_back']}. exchange_from_experts must undo "
                                  "exchange_to_experts: rows back to [E/ep, ep, C, d], source rank first, all-to-all "
                                  "home")
    return ("exchange_to_experts gives each local expert every rank's slots; exchange_from_experts undoes it (ep 4 and "
            "2)")


def judge_layer(results) -> str:
    for rank, r in enumerate(first_phase(results, "layer")):
        for key, run in r.items():
            for step, s in enumerate(run["steps"]):
                if s["routing_equal"][:2] != [True, True]:
                    raise CheckFailed(f"{key}: rank {rank} step {step}: the routing (choices, kept) differs from the "
                                      "single-process MoE")
                if not s["output"] <= ATOL:
                    raise CheckFailed(f"{key}: rank {rank} step {step}: the output differs from the single-process MoE "
                                      f"(excess {s['output']:.3g} over rtol 1e-6)")
                bad = sorted(name for name, need in s["grad_errors"].items() if not need <= ATOL)
                if bad:
                    why = (": the router learns only through the gates, so they must stay in the graph through combine"
                           if "moe.router.gate.weight" in bad and not any(n.startswith("moe.experts") for n in bad)
                           else "")
                    raise CheckFailed(f"{key}: rank {rank} step {step}: the gradients of {', '.join(bad)} differ from "
                                      f"the single-process MoE (worst excess {s['grads']['atol_needed']:.3g}){why}")
                a2a = s["all_to_all"]
                if not a2a["forward"] == a2a["backward"] == 2 * a2a["formula_one"]:
                    raise CheckFailed(f"{key}: rank {rank} sent {a2a['forward']:.0f} B forward and "
                                      f"{a2a['backward']:.0f} B backward by all-to-all, expected 2 x (ep-1)/ep E C d 4 "
                                      f"= {2 * a2a['formula_one']:.0f} B each")
            if not run["params"]["atol_needed"] <= ATOL:
                raise CheckFailed(f"{key}: rank {rank}: parameter `{run['params']['name']}` differs from one process "
                                  f"after {LAYER_STEPS} SGD steps")
    return (f"the MoE model with your functions equals the single-process MoE for {LAYER_STEPS} SGD steps (ep 4 top-1 "
            "skewed, ep 2 x expert-dp 2 top-2); all-to-all bytes = 4 x (ep-1)/ep E C d 4 per step")


CHECKS = [
    Check("expert_positions: slots, first choices first, capacity", 2, judged_check(judge_positions, measured)),
    Check("AllToAll: forward and backward exchange (4 ranks)", 2, judged_check(judge_alltoall, measured)),
    Check("dispatch and combine with dropped choices", 2, judged_check(judge_local, measured)),
    Check("exchange_to_experts / exchange_from_experts at ep 4 and 2", 2, judged_check(judge_exchange, measured)),
    Check("the MoE layer equals one process; all-to-all bytes = formula", 2,
          judged_check(judge_layer, measured, ("layer",))),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab12_moe_dispatch.py` shows."""
    from minizero.comm import Mesh
    from minizero_course.experiments.experts import side_by_side
    for k in (1, 2):
        res = side_by_side(Mesh(comm, ep=comm.size), k=k, capacity_factor=1.0, skew=1.0, ops=impl)
        everyone = comm.allgather_object(res["steps"][0])
        if comm.rank:
            continue
        print(f"\nMoE, E=4 experts over ep={comm.size} ranks, top-{k}, capacity factor 1.0, a skewed router:")
        for rank, s in enumerate(everyone):
            print(f"  rank {rank}: choices per expert {s['tokens_per_expert']}, C = {s['capacity']}, dropped "
                  f"{s['dropped']}, routing equal to one process {all(s['routing_equal'])}, output excess "
                  f"{s['output']:.1e}, worst gradient excess {s['grads']['atol_needed']:.1e}")
        a2a = everyone[0]["all_to_all"]
        print(f"  all-to-all bytes per pass: forward {a2a['forward']:.0f}, backward {a2a['backward']:.0f}; formula "
              f"2 x (ep-1)/ep E C d 4 = {2 * a2a['formula_one']:.0f}")
