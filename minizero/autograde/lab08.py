"""Lab 08 checks: your block-wise quantizer (4 and 8 bits) and quantized all-gather (qwZ) keep every
weight within half a quantization step of ZeRO-3's, gather in ONE asynchronous collective decoded
after wait(), train like ZeRO-3, and send the bytes of the formula.

Your quantize/dequantize run alone on one rank, on odd sizes, at bits 8 and 4, against the bound
scale/2 computed here from the exact values (never from your scales); a wrong result is compared
with the usual wrong quantizers (one scale per row, max x without abs, truncation, another
divisor) to name its cause. Then one 4-rank job (2 simulated nodes x 2) calls YOUR
quantized_all_gather through a communicator that watches its collectives and their handles, and
trains FSDP and ZeroPP with qwZ only, built on it (quantizer=); three checks read its report."""
import math

import torch
import torch.nn.functional as F

from minizero.autograde import Check, CheckFailed, Lab
from minizero.comm import ring_bytes_sent

LAB = Lab(8, "zeropp", "ZeRO++: block-wise int8 quantized all-gather", "minizero/zero/quantize.py")

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
    from minizero.experiments.references import global_batches
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
            facts["sent"].append({op: [s["sent_bytes"], s["cross_node_bytes"]] for op, s in comm.stats.as_dict().items()})
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
    return out


_cache = {}


def _results(impl, target="worker", nprocs=4):
    """One launch per (impl, worker), shared by the checks; a failure is re-raised to each of them."""
    from minizero import launch
    if (impl, target) not in _cache:
        try:
            _cache[impl, target] = launch.run(f"minizero.autograde.lab08:{target}", nprocs=nprocs, args={"impl": impl},
                                              timeout=240)
        except Exception as e:  # noqa: BLE001  (the grader reports it; see autograde.run_check)
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
            raise CheckFailed(f"{where}: dequantize_blockwise returned shape {q['back_shape']}, expected [2, {q['n']}]: "
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
                raise CheckFailed(f"{head}: the all-gather was blocking (async_op=False): issue it with async_op=True and "
                                  "wait in the handle's wait(), so that FSDP's prefetch overlaps it with compute")
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


CHECKS = [
    Check("block-wise 8- and 4-bit: |x - dq(q(x))| <= scale/2 at odd sizes", 3, check_quantizer),
    Check("one async all-gather per call, decoded after wait()", 2, check_one_async_gather),
    Check("qwZ gathers within scale/2 of ZeRO-3 and trains like it", 3, check_matches_zero3),
    Check("all-gather bytes = int8 codes + scales, cross-node as the ring model", 2, check_bytes),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab08_zeropp.py` shows."""
    from minizero.comm import Mesh
    from minizero.data import shard
    from minizero.experiments.references import global_batches
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
