"""Lab 08 checks: your block-wise int8 quantizer and quantized all-gather (qwZ) keep every weight
within half a quantization step of ZeRO-3's, train like ZeRO-3, and send the bytes of the formula.

Your quantize/dequantize run alone on one rank, on odd sizes, against the bound scale/2 computed
here from the exact values (never from your scales). Then one 4-rank job (2 simulated nodes x 2)
trains FSDP and ZeroPP with qwZ only, built on YOUR quantized_all_gather (quantizer=), and two
checks read its report (cached): the weights forward computes with, and comm.stats per step."""
import math

import torch

from minizero.autograde import Check, CheckFailed, Lab
from minizero.comm import ring_bytes_sent

LAB = Lab(8, "zeropp", "ZeRO++: block-wise int8 quantized all-gather", "minizero/zero/quantize.py")

GPT = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)  # experiments.zeropp.LESSON_GPT
BLOCK = 256              # elements per scale: shards of 1.2-3.2K elements get several blocks, one short
STEPS, LR = 4, 0.05
CASES = [(n, b) for n in (1, 7, 300, 1001) for b in (1, 64, 256)]  # sizes, block sizes: odd ones included
LOSS_TOL, PARAM_TOL = 0.01, 0.02  # vs ZeRO-3 after STEPS SGD steps (measured: ~1e-3 and ~2e-3)


def bound(x, block, qmax=127):
    """scale/2 per element, scale = max|block| / qmax, from the exact values."""
    rows, n = x.shape
    nb = math.ceil(n / block)
    blocks = torch.nn.functional.pad(x.abs(), (0, nb * block - n)).view(rows, nb, block)
    return (blocks.amax(-1) / qmax).repeat_interleave(block, dim=1)[:, :n] / 2


def excess(approx, exact, block, qmax=127):
    """|approx - exact| beyond the bound (and a few ulps), per element: > 0 is wrong."""
    return (approx.float() - exact).abs() - bound(exact, block, qmax) - exact.abs() * 2 ** -22


def _student(impl):
    import sys

    from minizero.launch import load_target
    return sys.modules[load_target(impl + ":quantized_all_gather").__module__]  # your file, as a module


def quantizer_worker(comm, impl):
    """Your quantize/dequantize alone (one rank: no collective)."""
    student, out = _student(impl), []
    gen = torch.Generator().manual_seed(0)
    for n, block in CASES:
        x = torch.randn(2, n, generator=gen) * torch.tensor([[0.01], [3.0]])
        x[1, n // 2] = 50.0  # an outlier: only its own block may lose precision
        codes, scales = student.quantize_blockwise(x, block)
        back = student.dequantize_blockwise(codes, scales, block).float()
        over = excess(back, x, block)
        row, col = divmod(int(over.argmax()), n)
        start = col // block * block
        inner = x.abs() < bound(x, block) * 2 * 127  # not the largest |x| of its block
        out.append({"n": n, "block": block, "dtype": str(codes.dtype), "shape": list(codes.shape),
                    "excess": float(over.max()), "at": [row, col], "bound": float(bound(x, block)[row, col]),
                    # what the error looks like, to name the cause:
                    "too_large": float(back.abs().max()) > 2 * float(x.abs().max()),
                    "toward_zero": bool((back.abs() <= x.abs() * (1 + 2 ** -22))[inner].all()) if inner.any() else None,
                    "row_scale": float(excess(back, x, n).max()) <= 0,  # fits max|row| / 127
                    "block_max": col == start + int(x[row, start:start + block].abs().argmax())})
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
    student, out = _student(impl), {}
    mesh = Mesh(comm, node_size=2)
    for name in ("zero3", "qwz"):
        net = build_model("tiny-gpt", seed=0, **GPT)
        exact = {n: p.detach().clone() for n, p in net.named_parameters()}
        w = FSDP(net, comm) if name == "zero3" else ZeroPP(net, mesh, quantized_weights=True, hpz=False,
                                                            quantized_gradients=False, weight_block_numel=BLOCK,
                                                            quantizer=student)
        seen = {}

        def keep(unit):  # runs after the wrapper's own pre-hook: unit.buf holds what forward computes with
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
                                      "int4": float(excess(seen[u.name].view(comm.size, -1), full, BLOCK, 7).max())})
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
        if q["dtype"] != "torch.int8" or q["shape"] != [2, q["n"]]:
            raise CheckFailed(f"{q['n']} elements in blocks of {q['block']}: codes are {q['dtype']} of shape "
                              f"{q['shape']}, expected torch.int8 of shape [2, {q['n']}] (one code per element, cut "
                              "back to n per row)")
    bad = [q for q in cases if q["excess"] > 0]
    if bad:  # name the cause from what the errors look like over all the cases
        cause = ("the dequantized values are far larger than x: multiply back each code by its block's scale"
                 if any(q["too_large"] for q in bad) else
                 "every value moved toward zero: round to the nearest code (torch.round); converting with "
                 ".to(torch.int8) alone truncates" if all(q["toward_zero"] is not False for q in cases) else
                 "the error fits ONE scale per row (max |x| of the whole row / 127), not one scale per block: "
                 "take max |x| over each block of block_numel elements" if all(q["row_scale"] for q in bad) else
                 "the worst element is the largest |x| of its block: scale = max|x| / 127 maps it to exactly +-127 "
                 "(another divisor clips it)" if all(q["block_max"] for q in bad) else
                 "scale = max|x| of ITS block / 127, round to the nearest code, multiply back by the scale")
        q = max(bad, key=lambda q: q["excess"])
        row, col = q["at"]
        raise CheckFailed(f"{q['n']} elements in blocks of {q['block']}: row {row}, element {col} (block "
                          f"{col // q['block']}): |x - dq(q(x))| exceeds scale/2 = {q['bound']:.3g} by "
                          f"{q['excess']:.3g} ({len(bad)} of {len(cases)} cases fail); {cause}")
    return f"{len(CASES)} sizes x block sizes (odd ones, a short last block, an outlier): every |x - dq(q(x))| <= scale/2"


def check_matches_zero3(impl):
    res = _results(impl)
    for rank, r in enumerate(res):
        for g in r["qwz"]["gathered"]:
            if g["excess"] > 0:
                owner, col = g["at"]
                cause = (f"your own shard (rank {rank}) is right but rank {owner}'s is not: decode each rank's row "
                         "(its codes AND its scales) from what was gathered" if g["by_owner"][rank] <= 0 else
                         "the error fits 4-bit codes (qmax 7), not int8: quantize the weights with bits=8"
                         if g["int4"] <= 0 else "quantize with quantize_blockwise and dequantize what was gathered")
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
    Check("block-wise int8: |x - dq(q(x))| <= scale/2 at odd sizes", 3, check_quantizer),
    Check("qwZ gathers within scale/2 of ZeRO-3 and trains like it", 4, check_matches_zero3),
    Check("all-gather bytes = int8 codes + scales, cross-node as the ring model", 3, check_bytes),
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
