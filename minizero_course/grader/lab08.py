"""Lab 08 checks: your block-wise quantizer (4 and 8 bits) and quantized all-gather (qwZ) keep every
weight within half a quantization step of ZeRO-3's, gather in ONE asynchronous collective decoded
after wait(), train like ZeRO-3, and send the bytes of the formula.

Your quantize/dequantize run alone on one rank, on odd sizes, at bits 8 and 4, against the bound
scale/2 computed here from the exact values (never from your scales); a wrong result is compared
with the usual wrong quantizers (one scale per row, max x without abs, truncation, another
divisor) to name its cause. Then one 4-rank job (2 simulated nodes x 2) calls YOUR
quantized_all_gather through a communicator that watches its collectives and their handles, and
trains FSDP and ZeroPP with qwZ only, built on it (quantizer=); three checks read its report.
The stretch task (extra points), hpZ's secondary partition, is YOUR ZeroPP with hpZ only, trained in
the same job after those two: the part each rank keeps (which 1/k of each unit, the bytes behind it),
the backward all-gathers' bytes (none cross-node) and the values (ZeRO-3's, bitwise) are checked."""
import math

import torch
import torch.nn.functional as F

from minizero_course.grader import Check, CheckFailed, Lab
from minizero.comm import ring_bytes_sent

LAB = Lab(8, "zeropp", "ZeRO++: block-wise int8 quantized all-gather",
          ("minizero/zero/quantize.py", "minizero/zero/zeropp.py"))

GPT = {"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16}  # experiments.zeropp.LESSON_GPT
BLOCK = 256              # elements per scale: shards of 1.2-3.2K elements get several blocks, one short
STEPS, LR = 4, 0.05
CASES = [(n, b, bits) for bits in (8, 4) for n in (1, 7, 300, 1001) for b in (1, 64, 256)]  # odd sizes included
CALL_NUMEL, CALL_BLOCK = 1001, 64  # the watched quantized_all_gather call: a short last block
LOSS_TOL, PARAM_TOL = 0.01, 0.02  # vs ZeRO-3 after STEPS SGD steps (measured: ~1e-3 and ~2e-3)


def qmax_of(bits):
    return 2 ** (bits - 1) - 1


def bound(x, block, qmax=127):
    """scale/2 per element, scale = max|block| / qmax, from the exact values."""
    rows, n = x.shape
    nb = math.ceil(n / block)
    blocks = F.pad(x.abs(), (0, nb * block - n)).view(rows, nb, block)
    return (blocks.amax(-1) / qmax).repeat_interleave(block, dim=1)[:, :n] / 2


def excess(approx, exact, block, qmax=127):
    """|approx - exact| beyond the bound (and a few ulps), per element: > 0 is wrong."""
    return (approx.float() - exact).abs() - bound(exact, block, qmax) - exact.abs() * 2 ** -22


def fingerprint(back, x, block, qmax) -> list[str]:
    """What the errors of a wrong dq(q(x)) look like, most telling first: which usual mistake
    they fit (each test is a property of the errors, not of one way to write the bug)."""
    over = excess(back, x, block, qmax)
    bad = over > 0
    if not bad.any():
        return []
    rows, n = x.shape
    nb = math.ceil(n / block)
    blocks = F.pad(x, (0, nb * block - n)).view(rows, nb, block)
    negative_top = (blocks.amax(-1) < blocks.abs().amax(-1)).repeat_interleave(block, dim=1)[:, :n]
    out = []
    if float(excess(back, x, n, qmax).max()) <= 0:
        out.append("per_row")        # fits one scale per row
    if bool(negative_top[bad].all()):
        out.append("signed")         # only blocks whose largest magnitude is negative are wrong
    near_top = x.abs() >= (qmax - 1) / qmax * blocks.abs().amax(-1).repeat_interleave(block, dim=1)[:, :n]
    if bool((near_top & (back.float().abs() < x.abs()))[bad].all()):
        out.append("divisor")        # only values next to the block's largest |x| are wrong: clipped
    if bool((back.float().abs() <= x.abs() * (1 + 2 ** -22)).all()):
        out.append("trunc")          # everything moved toward zero (rounding moves about half away)
    if qmax == 127 and float(excess(back, x, block, 7).max()) <= 0:
        out.append("int4")           # fits 4-bit codes
    return out


CAUSES = {  # what a fingerprint means, for a quantizer tested alone ("row") or a gathered shard ("shard")
    "per_row": "the error fits ONE scale per {what} (max |x| of the whole {what} / qmax), not one scale per block: "
               "take max |x| over each block of block_numel elements",
    "signed": "the scale is max x of the block, not max |x|: a block whose largest magnitude is negative is clipped "
              "(take the absolute value before the max)",
    "divisor": "only the values next to their block's largest |x| are wrong, clipped: scale = max|x| / qmax maps "
               "the largest to exactly +-qmax (dividing by qmax + 1 = 2^(bits-1) clips it)",
    "trunc": "every value moved toward zero: round to the nearest code (torch.round); converting with .to(torch.int8) "
             "alone truncates",
    "int4": "the error fits 4-bit codes (qmax 7), not int8: quantize the weights with bits=8",
}


def _student(impl):
    import sys

    from minizero.launch import load_target
    return sys.modules[load_target(impl + ":quantized_all_gather").__module__]  # your file, as a module


def quantizer_worker(comm, impl):
    """Your quantize/dequantize alone (one rank: no collective)."""
    student, out = _student(impl), []
    gen = torch.Generator().manual_seed(0)
    for n, block, bits in CASES:
        qmax = qmax_of(bits)
        x = torch.randn(2, n, generator=gen) * torch.tensor([[0.01], [3.0]])
        x[1, n // 2] = -50.0  # a negative outlier: only its own block may lose precision
        codes, scales = student.quantize_blockwise(x, block, bits)
        case = {"n": n, "block": block, "bits": bits, "dtype": str(codes.dtype), "shape": list(codes.shape)}
        out.append(case)
        if case["dtype"] != "torch.int8" or case["shape"] != [2, n]:
            continue  # judged by its shape: nothing below would mean anything
        case["code_range"] = int(codes.abs().max())
        back = student.dequantize_blockwise(codes, scales, block)
        case["back_shape"] = list(back.shape)
        if list(back.shape) != [2, n]:
            continue
        back = back.float()
        over = excess(back, x, block, qmax)
        row, col = divmod(int(over.argmax()), n)
        case.update({"excess": float(over.max()), "at": [row, col], "bound": float(bound(x, block, qmax)[row, col]),
                     "too_large": float(back.abs().max()) > 2 * float(x.abs().max()),
                     "looks_like": fingerprint(back, x, block, qmax)})
    return out


class Watched:
    """The communicator, with every collective counted and each all-gather's handle watched."""

    def __init__(self, comm):
        self.comm = comm       # the real one
        self.calls = []        # [op, async_op] per collective
        self.waited = []       # True once the i-th all-gather's handle was waited on

    def __getattr__(self, name):
        real = getattr(self.comm, name)
        if name not in ("all_reduce", "reduce_scatter", "broadcast", "all_to_all", "send", "recv", "barrier"):
            return real

        def counted(*args, **kwargs):
            self.calls.append([name, bool(kwargs.get("async_op"))])
            return real(*args, **kwargs)
        return counted

    def all_gather(self, output, input, async_op=False):
        self.calls.append(["all_gather", bool(async_op)])
        work = self.comm.all_gather(output, input, async_op=async_op)
        self.waited.append(not async_op)
        if not async_op:
            return work
        watched, i = self, len(self.waited) - 1

        class Handle:
            def wait(self):
                watched.waited[i] = True
                return work.wait()

            def is_completed(self):
                return work.is_completed()
        return Handle()


def call_phase(comm, student):
    """One async and one blocking quantized_all_gather of odd shards, watched."""
    from minizero.comm import Mesh  # noqa: F401  (the same imports as training; keeps the job's start-up shared)
    shards = [torch.randn(CALL_NUMEL, generator=torch.Generator().manual_seed(100 + r)) * (1 + r)
              for r in range(comm.size)]
    exact = torch.stack(shards)
    out = {}
    for mode in ("async", "blocking"):
        watched = Watched(comm)
        output = torch.full((comm.size * CALL_NUMEL,), float("nan"))
        handle = student.quantized_all_gather(watched, output, shards[comm.rank].clone(), CALL_BLOCK,
                                              async_op=mode == "async")
        facts = {"calls": list(watched.calls), "returned": type(handle).__name__,
                 "waited_before_return": any(watched.waited), "written_before_wait": bool(~output.isnan().all())}
        if mode == "async" and hasattr(handle, "wait"):
            handle.wait()
        facts["waited_after"] = all(watched.waited)
        got = output.view(comm.size, -1)
        facts["nan"] = bool(got.isnan().any())
        facts["excess"] = float(excess(got.nan_to_num(), exact, CALL_BLOCK).max())
        out[mode] = facts
    return out


def worker(comm, impl):
    """On every rank: FSDP, then ZeroPP with qwZ only on YOUR quantized_all_gather (quantizer=)."""
    from minizero.comm import Mesh
    from minizero.data import shard
    from minizero_course.experiments.references import global_batches
    from minizero.models import build_model
    from minizero.zero.fsdp import FSDP
    from minizero.zero.zeropp import ZeroPP
    torch.set_num_threads(1)
    student = _student(impl)
    out = {"call": call_phase(comm, student)}
    mesh = Mesh(comm, node_size=2)
    for name in ("zero3", "qwz"):
        net = build_model("tiny-gpt", seed=0, **GPT)
        exact = {n: p.detach().clone() for n, p in net.named_parameters()}
        w = FSDP(net, comm) if name == "zero3" else ZeroPP(net, mesh, quantized_weights=True, hpz=False,
                                                            quantized_gradients=False, weight_block_numel=BLOCK,
                                                            quantizer=student)
        seen = {}

        def keep(unit, seen=seen):  # runs after the wrapper's own pre-hook: unit.buf holds what forward computes with
            seen.setdefault(unit.name, unit.buf[:unit.gathered_numel].clone())
        for u in w.units:
            u.module.register_forward_pre_hook(lambda m, a, u=u: keep(u))
        opt = torch.optim.SGD(w.parameters(), lr=LR)
        facts = {"losses": [], "sent": []}
        for batch in global_batches(net, STEPS, 4 * comm.size):
            comm.stats.reset()
            loss = w(*shard(batch, comm.rank, comm.size))[1]
            loss.backward()
            facts["sent"].append({op: [s["sent_bytes"], s["cross_node_bytes"]]
                                  for op, s in comm.stats.as_dict().items()})
            opt.step()
            opt.zero_grad(set_to_none=True)
            facts["losses"].append(loss.item())
        facts["gathered"] = []
        for u in w.units:  # step 0's gathered weights against the exact ones, shard by shard
            full = u.layout.flatten([exact[names[0]] for _, _, names in u.entries]).view(comm.size, -1)
            over = excess(seen[u.name].view(comm.size, -1), full, BLOCK)
            facts["gathered"].append({"unit": u.name, "excess": float(over.max()),
                                      "at": divmod(int(over.argmax()), full.shape[1]),
                                      "by_owner": over.amax(dim=1).tolist(), "padded": u.gathered_numel,
                                      "looks_like": fingerprint(seen[u.name].view(comm.size, -1), full, BLOCK, 127)})
        facts["params"] = torch.cat([v.reshape(-1) for v in w.gather_full_params().values()]).tolist()
        out[name] = facts
    out["hpz"] = hpz_run(comm, student, mesh)
    return out


def _part_kept(unit, full, secondary, k):
    """What this rank keeps of `unit` after a forward: its size, which aligned 1/k.. part of the unit
    it equals (None: none), and the bytes of the storage behind it (a view keeps its whole base alive)."""
    if not isinstance(secondary, torch.Tensor):
        return {"unit": unit.name, "numel": None, "want": unit.gathered_numel // k, "gathered": unit.gathered_numel}
    n = secondary.numel()
    parts = full.view(-1, n) if n and full.numel() % n == 0 else full[:0].view(0, max(n, 1))
    match = [i for i in range(parts.shape[0]) if torch.equal(parts[i], secondary.detach().reshape(-1))]
    return {"unit": unit.name, "numel": n, "want": unit.gathered_numel // k, "gathered": unit.gathered_numel,
            "part": match[0] if match else None, "storage_bytes": secondary.untyped_storage().nbytes(),
            "ptr": secondary.untyped_storage().data_ptr()}


def hpz_run(comm, student, mesh):
    """The stretch task: YOUR ZeroPP with hpZ only (no quantization) over 2 simulated nodes, the zero3 run's
    steps. Its stub is recorded, not raised: an untouched stretch task costs the main checks nothing. After
    step 0's forward every rank's kept parts are compared (one allgather): if a size is wrong everywhere
    backward is not run, as its all-gather over the node could not fill the unit."""
    from minizero.data import shard
    from minizero_course.experiments.references import global_batches
    from minizero.models import build_model
    if not hasattr(student, "ZeroPP"):
        return {"error": "your file has no ZeroPP class: it is lab 08's file, generated by `make labs`"}
    k, error = mesh.node_size, None
    facts = {"losses": [], "backward": [], "gathers": [], "k": k, "node_rank": mesh.node.rank,
             "node": mesh.node_index}
    node, mesh.node = mesh.node, Watched(mesh.node)  # hpZ's backward all-gathers, watched (restored below)
    try:
        net = build_model("tiny-gpt", seed=0, **GPT)
        w = student.ZeroPP(net, mesh, quantized_weights=False, hpz=True, quantized_gradients=False)
        gather_shards = w._gather_shards

        def watched_gather(unit, buf, src):  # was the node all-gather issued here still in flight on return?
            issued = len(mesh.node.waited)
            out = gather_shards(unit, buf, src)
            if len(mesh.node.waited) > issued:
                facts["gathers"][-1].append({"async": [c for c in mesh.node.calls if c[0] == "all_gather"][-1][1],
                                             "in_flight": not mesh.node.waited[-1]})
            return out
        w._gather_shards = watched_gather
        seen = {}

        def keep(unit):  # the unit as forward computes with it, gathered from the primary shards
            seen.setdefault(unit.name, unit.buf[:unit.gathered_numel].clone())
        for u in w.units:
            u.module.register_forward_pre_hook(lambda m, a, u=u: keep(u))
        opt = torch.optim.SGD(w.parameters(), lr=LR)
        for step, batch in enumerate(global_batches(net, STEPS, 4 * comm.size)):
            loss = w(*shard(batch, comm.rank, comm.size))[1]
            if step == 0:
                facts["parts"] = [_part_kept(u, seen[u.name], w.secondary.get(u), k) for u in w.units
                                  if u.gathered_numel]
                held = {p["ptr"]: p["storage_bytes"] for p in facts["parts"] if p["numel"] is not None}
                facts["held_bytes"] = sum(held.values())  # bytes behind this rank's secondary partition
                facts["shard_bytes"] = sum(u.shard.numel() * u.shard.element_size() for u in w.units
                                           if u.gathered_numel)
                if not all(p["numel"] == p["want"] for r in comm.allgather_object(facts["parts"]) for p in r):
                    return facts
            comm.stats.reset()
            facts["gathers"].append([])
            loss.backward()
            facts["backward"].append({op: [s["sent_bytes"], s["cross_node_bytes"]]
                                      for op, s in comm.stats.as_dict().items()})
            opt.step()
            opt.zero_grad(set_to_none=True)
            facts["losses"].append(loss.item())
        facts["params"] = torch.cat([v.reshape(-1) for v in w.gather_full_params().values()]).tolist()
    except NotImplementedError as e:  # the same stub on every rank, at the same point: no collective is left waiting
        return {"stub": str(e)}
    except Exception as e:  # noqa: BLE001 - what the student's code raised is the result (on every rank alike)
        error = f"{type(e).__name__}: {e}"
    finally:
        mesh.node = node
    errors = [e for e in comm.allgather_object(error) if e]
    return {"error": errors[0]} if errors else facts


_cache = {}


def _results(impl, target="worker", nprocs=4):
    """One launch per (impl, worker), shared by the checks; a failure is re-raised to each of them."""
    from minizero import launch
    if (impl, target) not in _cache:
        try:
            _cache[impl, target] = launch.run(f"minizero_course.grader.lab08:{target}", nprocs=nprocs,
                                              args={"impl": impl}, timeout=240)
        except Exception as e:  # noqa: BLE001  (the grader reports it; see grader.run_check)
            _cache[impl, target] = e
    if isinstance(_cache[impl, target], Exception):
        raise _cache[impl, target]
    return _cache[impl, target]


def check_quantizer(impl):
    cases = _results(impl, "quantizer_worker", 1)[0]
    for q in cases:
        where = f"{q['n']} elements in blocks of {q['block']}, bits={q['bits']}"
        if q["dtype"] != "torch.int8" or q["shape"] != [2, q["n"]]:
            padded = q["shape"][1:] == [math.ceil(q["n"] / q["block"]) * q["block"]] if len(q["shape"]) == 2 else False
            raise CheckFailed(f"{where}: codes are {q['dtype']} of shape {q['shape']}, expected torch.int8 of shape "
                              f"[2, {q['n']}]: one code per element, "
                              + ("the padding of the last block cut off (it is never sent)" if padded else
                                 "cut back to n per row"))
        if q["code_range"] > qmax_of(q["bits"]):
            raise CheckFailed(f"{where}: a code is {q['code_range']}, outside [-{qmax_of(q['bits'])}, "
                              f"{qmax_of(q['bits'])}]: qmax = 2^(bits-1) - 1 depends on bits (a {q['bits']}-bit code "
                              "must fit the wire format)")
        if q["back_shape"] != [2, q["n"]]:
            raise CheckFailed(f"{where}: dequantize_blockwise returned shape {q['back_shape']}, expected [2, "
                              f"{q['n']}]: "
                              "one value per code")
    bad = [q for q in cases if q["excess"] > 0]
    if bad:  # name the cause from what the wrong results look like
        q = max(bad, key=lambda q: q["excess"])
        seen = [k for k in CAUSES if k != "int4" and all(k in b["looks_like"] for b in bad)]
        cause = ("the dequantized values are far larger than x: multiply back each code by its block's scale"
                 if any(b["too_large"] for b in bad) else
                 CAUSES[seen[0]].format(what="row") if seen else
                 "scale = max|x| of ITS block / qmax, round to the nearest code, multiply back by the scale")
        row, col = q["at"]
        raise CheckFailed(f"{q['n']} elements in blocks of {q['block']}, bits={q['bits']}: row {row}, element {col} "
                          f"(block {col // q['block']}): |x - dq(q(x))| exceeds scale/2 = {q['bound']:.3g} by "
                          f"{q['excess']:.3g} ({len(bad)} of {len(cases)} cases fail); {cause}")
    return (f"{len(CASES)} sizes x block sizes x bits 8, 4 (odd ones, a short last block, a negative outlier): "
            "every |x - dq(q(x))| <= scale/2, codes in [-qmax, qmax]")


def check_one_async_gather(impl):
    res = _results(impl)
    for rank, r in enumerate(res):
        for mode, c in r["call"].items():
            gathers = [a for op, a in c["calls"] if op == "all_gather"]
            others = sorted({op for op, _ in c["calls"] if op != "all_gather"})
            head = f"rank {rank}, quantized_all_gather(async_op={mode == 'async'})"
            if others:
                raise CheckFailed(f"{head} ran {', '.join(others)}: qwZ needs one all-gather and nothing else")
            if len(gathers) != 1:
                raise CheckFailed(f"{head} ran {len(gathers)} all-gathers, expected 1: send codes and scales as ONE "
                                  "message (encode's [codes | scale bytes] row); each collective pays its own latency")
            if mode != "async":
                continue
            if not gathers[0]:
                raise CheckFailed(f"{head}: the all-gather was blocking (async_op=False): issue it with async_op=True "
                                  "and wait in the handle's wait(), so that FSDP's prefetch overlaps it with compute")
            if c["returned"] == "NoneType":
                raise CheckFailed(f"{head} returned None: return a handle (Pending) whose wait() completes the gather")
            if c["waited_before_return"]:
                raise CheckFailed(f"{head} waited on the all-gather before returning: the gather must still be in "
                                  "flight when the call returns (wait inside finish(), called by the handle's wait())")
            if c["written_before_wait"]:
                raise CheckFailed(f"{head} wrote into output before wait(): decode the gathered rows only after the "
                                  "all-gather completed (before, they are still being received)")
            if not c["waited_after"]:
                raise CheckFailed(f"{head}: the handle's wait() never waited on the all-gather: its bytes are valid "
                                  "only after that wait")
        for mode, c in r["call"].items():
            if c["nan"] or c["excess"] > 0:
                raise CheckFailed(f"rank {rank}, quantized_all_gather(async_op={mode == 'async'}) of {res[0]['call']} "
                                  f"shards of {CALL_NUMEL}: "
                                  + ("part of output was never written: decode every rank's row into it" if c["nan"]
                                     else f"a gathered value is off by more than scale/2 (by {c['excess']:.3g})"))
    return (f"one async all-gather per call (codes + scales together), nothing written before wait(), every value "
            f"within scale/2 ({len(res)} ranks, shards of {CALL_NUMEL}, blocks of {CALL_BLOCK})")


def check_matches_zero3(impl):
    res = _results(impl)
    for rank, r in enumerate(res):
        for g in r["qwz"]["gathered"]:
            if g["excess"] > 0:
                owner, col = g["at"]
                seen = [k for k in CAUSES if k in g["looks_like"]]
                cause = (f"your own shard (rank {rank}) is right but rank {owner}'s is not: decode each rank's row "
                         "(its codes AND its scales) from what was gathered" if g["by_owner"][rank] <= 0 else
                         CAUSES[seen[0]].format(what="shard") if seen else
                         "quantize with quantize_blockwise and dequantize what was gathered")
                raise CheckFailed(f"rank {rank}, unit {g['unit']}: the gathered weight {col} of rank {owner}'s shard "
                                  f"is off from ZeRO-3's by more than scale/2 (by {g['excess']:.3g}; blocks of {BLOCK} "
                                  f"elements, int8): {cause}")
    q, z = res[0]["qwz"], res[0]["zero3"]
    loss_diff = max(abs(a - b) for a, b in zip(q["losses"], z["losses"]))
    param_diff = max(abs(a - b) for a, b in zip(q["params"], z["params"]))
    if loss_diff > LOSS_TOL or param_diff > PARAM_TOL:
        raise CheckFailed(f"after {STEPS} SGD steps: losses differ from ZeRO-3's by up to {loss_diff:.3g} (allowed "
                          f"{LOSS_TOL}), parameters by {param_diff:.3g} (allowed {PARAM_TOL})")
    return (f"every gathered weight within scale/2 of ZeRO-3's; after {STEPS} steps |loss - ZeRO-3| <= "
            f"{loss_diff:.1e}, |param - ZeRO-3| <= {param_diff:.1e}")


def check_bytes(impl):
    res = _results(impl)
    n, k = len(res), 2
    padded = [g["padded"] for g in res[0]["qwz"]["gathered"]]
    # per unit, forward and backward: one row per rank, int8 codes (1 B/element) + an fp32 scale per block
    payload = sum(p + 4 * n * math.ceil(p // n / BLOCK) for p in padded)
    want = 2 * ring_bytes_sent("all_gather", payload, n)
    for rank, r in enumerate(res):
        for step, sent in enumerate(r["qwz"]["sent"]):
            got, cross = sent.get("all_gather", [0.0, 0.0])
            want_cross = want if (rank + 1) % n // k != rank // k else 0.0  # ring successor on another node
            if abs(got - want) > 1e-6 or abs(cross - want_cross) > 1e-6:
                raise CheckFailed(f"rank {rank}, step {step}: all-gathers sent {got:.0f} B ({cross:.0f} B cross-node), "
                                  f"expected {want:.0f} B ({want_cross:.0f} B cross-node): int8 codes, 1 byte per "
                                  f"element, plus one fp32 scale per block, gathered in forward and backward")
    z = res[0]["zero3"]["sent"][-1]["all_gather"][0]
    return f"all-gathers: {want:.0f} B per rank per step = {want / z:.3f} x ZeRO-3's fp32 {z:.0f} B"


def _judge_hpz_parts(where, h, n, k):
    """The part of each unit this rank keeps after forward: its size, which part, the bytes behind it."""
    for p in h["parts"]:
        unit = f"unit {p['unit']} (Ψu = {p['gathered']} elements)"
        if p["numel"] is None:
            raise CheckFailed(f"{where} keeps nothing in self.secondary for {unit} after forward: hpZ's secondary "
                              f"partition is that rank's 1/k of the unit, Ψu/k = {p['want']} elements")
        if p["numel"] != p["want"]:
            what = ("the whole unit: keep only your part, 1/k of it (memory + Ψ·b/k per rank, not + Ψ·b)"
                    if p["numel"] == p["gathered"] else
                    f"1/N of the unit (N = {n}), sharded over the world: the secondary partition is sharded over "
                    f"the k = {k} ranks of mesh.node, so that backward finds the whole unit inside the node"
                    if p["numel"] * n == p["gathered"] else
                    "the slice runs past the unit's end: part j starts at j·Ψu/k, j = mesh.node.rank < k (the rank "
                    "inside the node, not the world rank)" if p["numel"] < p["want"] else
                    "its part is 1/k of the unit, k = mesh.node.size")
            raise CheckFailed(f"{where} keeps {p['numel']} elements of {unit}, expected Ψu/k = {p['want']}: {what}")
        if p["part"] != h["node_rank"]:
            kept = f"part {p['part']}" if p["part"] is not None else "none of its k parts"
            raise CheckFailed(f"{where} keeps {kept} of {unit}, expected part {h['node_rank']}: the rank j of a node "
                              "keeps part j (j = mesh.node.rank, its rank inside the node, not the node's index nor "
                              "the world rank), because the all-gather over the node puts rank j's tensor at part j")
    want = sum(p["want"] for p in h["parts"]) * 4
    if h["held_bytes"] != want:
        raise CheckFailed(f"{where} holds {h['held_bytes']} B behind its secondary partition, expected Ψ·b/k = "
                          f"{want} B (fp32): a view of the gathered buffer keeps the whole buffer alive; keep a copy "
                          "of your part (a tensor of its own)")


def check_hpz(impl):
    res = _results(impl)
    if "stub" in res[0]["hpz"]:
        raise CheckFailed(res[0]["hpz"]["stub"])
    for rank, r in enumerate(res):
        if "error" in r["hpz"]:
            e = r["hpz"]["error"]
            raise CheckFailed(f"rank {rank}: your ZeroPP with hpZ failed: {e}" + (
                "\nbackward's all-gather joins the k parts of Ψu/k kept in the node: over mesh.node (k x Ψu/k = Ψu "
                "elements), not over the world" if e.startswith("ValueError: all_gather") else ""))
    n, k = len(res), res[0]["hpz"]["k"]
    hpz = [(f"rank {rank} (node {r['hpz']['node']}, rank {r['hpz']['node_rank']} of its {k})", r["hpz"])
           for rank, r in enumerate(res)]
    for where, h in hpz:
        _judge_hpz_parts(where, h, n, k)
    for where, h in hpz:
        for step, gathers in enumerate(h["gathers"]):
            held = [g for g in gathers if not g["in_flight"]]
            if held:
                how = ("blocking (async_op=False)" if not held[0]["async"] else
                       "waited for before _gather_shards returned")
                raise CheckFailed(f"{where}, step {step}: the backward all-gather over mesh.node was {how} "
                                  f"({len(held)} of {len(gathers)} units): issue it with async_op=True and leave "
                                  "its handle in unit.work, so that it is in flight while the unit before it computes "
                                  "its backward (FSDP waits for unit.work when the unit is needed)")
    for where, h in hpz:  # cross-node bytes first, on every rank: a ring leaves the node on some ranks only
        for step, sent in enumerate(h["backward"]):
            if sent.get("all_gather", [0.0, 0.0])[1] > 0:
                raise CheckFailed(f"{where}, step {step}: the backward all-gathers sent {sent['all_gather'][1]:.0f} B "
                                  "cross-node, expected 0: gather the unit from the node's secondary partitions over "
                                  "mesh.node, not over the world (that is ZeRO-3's backward gather again)")
    for where, h in hpz:
        within = ring_bytes_sent("all_gather", sum(p["gathered"] for p in h["parts"]) * 4, k)
        for step, sent in enumerate(h["backward"]):
            if abs(sent.get("all_gather", [0.0, 0.0])[0] - within) > 1e-6:
                raise CheckFailed(f"{where}, step {step}: the backward all-gathers sent {sent['all_gather'][0]:.0f} B, "
                                  f"expected (k-1)/k·Ψ·b = {within:.0f} B: one all-gather of the k parts over "
                                  "mesh.node per unit")
    h, z = res[0]["hpz"], res[0]["zero3"]
    if h["losses"] != z["losses"] or h["params"] != z["params"]:
        diff = max(abs(a - b) for a, b in zip(h["params"] + h["losses"], z["params"] + z["losses"]))
        raise CheckFailed(f"after {STEPS} SGD steps your hpZ differs from ZeRO-3 by up to {diff:.3g} (losses, "
                          "parameters): backward must compute with the very weights forward gathered")
    z_sent, z_cross = res[-1]["zero3"]["sent"][-1]["all_gather"]
    return (f"hpZ on {n} ranks in nodes of {k}: every rank keeps part mesh.node.rank of every unit, {h['held_bytes']} "
            f"B = Ψ·4/k (its primary shard: {h['shard_bytes']} B); backward all-gathers "
            f"{h['backward'][-1]['all_gather'][0]:.0f} B per rank, 0 B cross-node on every rank (ZeRO-3, forward + "
            f"backward: {z_sent:.0f} B on rank {n - 1}, {z_cross:.0f} B of it cross-node); losses and parameters after "
            f"{STEPS} steps equal ZeRO-3's bitwise")


CHECKS = [
    Check("block-wise 8- and 4-bit: |x - dq(q(x))| <= scale/2 at odd sizes", 3, check_quantizer),
    Check("one async all-gather per call, decoded after wait()", 2, check_one_async_gather),
    Check("qwZ gathers within scale/2 of ZeRO-3 and trains like it", 3, check_matches_zero3),
    Check("all-gather bytes = int8 codes + scales, cross-node as the ring model", 2, check_bytes),
    Check("stretch: hpZ's secondary partition, backward gathers inside the node, values = ZeRO-3 (extra points)", 2,
          check_hpz, extra=True),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab08_zeropp.py` shows."""
    from minizero.comm import Mesh
    from minizero.data import shard
    from minizero_course.experiments.references import global_batches
    from minizero.models import build_model
    from minizero.zero.fsdp import FSDP
    from minizero.zero.zeropp import ZeroPP
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    codes, scales = impl.quantize_blockwise(x, BLOCK)
    err = (impl.dequantize_blockwise(codes, scales, BLOCK) - x).abs()
    mesh = Mesh(comm, node_size=2 if comm.size % 2 == 0 else 1)
    rows = {}
    for name in ("ZeRO-3", "qwZ"):
        net = build_model("tiny-gpt", seed=0, **GPT)
        w = FSDP(net, comm) if name == "ZeRO-3" else ZeroPP(
            net, mesh, quantized_weights=True, hpz=False, quantized_gradients=False, weight_block_numel=BLOCK,
            quantizer=impl)
        opt = torch.optim.SGD(w.parameters(), lr=LR)
        losses = []
        for batch in global_batches(net, 5, 4 * comm.size):
            comm.stats.reset()
            loss = w(*shard(batch, comm.rank, comm.size))[1]
            loss.backward()
            sent, cross = comm.stats.sent(), comm.stats.cross_node()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        rows[name] = (losses, comm.allgather_object((sent, cross)))
    if comm.rank == 0:
        print(f"your quantizer, blocks of {BLOCK}: max |x - dq(q(x))| = {err.max():.2e}, max scale/2 = "
              f"{scales.max() / 2:.2e} ({codes.dtype}, {codes.numel()} codes, {scales.numel()} scales)")
        print(f"TinyGPT {GPT} on {comm.size} ranks in nodes of {mesh.node_size}, SGD; ZeRO-3 vs ZeRO-3 + your qwZ:")
        for step, (a, b) in enumerate(zip(*(rows[n][0] for n in rows))):
            print(f"  step {step}: loss {a:.5f} vs {b:.5f}")
        for name, (_, per_rank) in rows.items():
            print(f"  {name:>6}: bytes sent per rank per step " + ", ".join(
                f"r{r} {s:.0f} ({c:.0f} cross-node)" for r, (s, c) in enumerate(per_rank)))
