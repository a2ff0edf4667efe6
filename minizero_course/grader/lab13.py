"""Lab 13 checks: your 1-bit compression with error feedback and the compressed all-reduce
(minizero/compression/onebit.py) against the reference, then inside OneBitAdam against the reference and
plain Adam.

ONE 4-rank job measures everything (`measure_worker`); each check judges its part (`judge_*`), so the
grader launches once per submission and the mutation suite (tests/mutants/lab13.py) grades all its
mutants in one job too. Phases, one after the other on every rank:
  compress   compress on hand-made vectors (some elements of c exactly 0), with an error buffer and
             without, beside the reference's
  allreduce  compressed_allreduce of rank-dependent vectors (odd size, padded) with nonzero error buffers:
             result and both errors against the reference's, collectives and bytes (comm.stats); the
             result of one scale per chunk, simulated
  feedback   the same vector all-reduced again and again: the running mean against the true mean
  adam       OneBitAdam with your all-reduce on TinyGPT (warm-up, then compressed steps) against the
             reference's and against plain Adam
  zeroone    (stretch) your ZeroOnePolicy's schedule and intervals beside the reference's, and ZeroOneAdam
             with your policy and all-reduce on TinyGPT: bytes per step, against the reference's and Adam
A phase that raises in your code is recorded (with the error) and the next phase runs.
"""
from __future__ import annotations

import torch

from minizero_course.grader import Check, CheckFailed, Lab, first_phase, judged_check, launched_once
from minizero_course.grader.lab10 import _ops, measure_phases

LAB = Lab(13, "onebit", "1-bit Adam: error-compensated 1-bit compression and its all-reduce",
          ("minizero/compression/onebit.py", "minizero/compression/zero_one_adam.py"))

RTOL = 1e-5  # only the order of float32 operations may differ from the reference
NUMEL = 1001  # padded to 1024 on 4 ranks: chunks of 256 elements, 32 bytes of signs each
FEEDBACK_CALLS = (1, 10, 200)
ADAM_STEPS, ADAM_FREEZE = 24, 6
ADAM_GPT = dict(n_layer=1, n_embd=32, n_head=4, block_size=16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of a from b (inf if the shapes differ)."""
    if a.shape != b.shape:
        return float("inf")
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _vector(seed, n, shift=0.0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) + shift


ZEROS = [3, 17, 40, 41]  # where compress's c = x + error is exactly 0: sign(0) must be +1 there


# ------------------------------------------------------------------------------ the phases
def compress_phase(comm, mod):
    from minizero.compression import onebit as ref
    x, e0 = _vector(1, 64), 0.3 * _vector(2, 64)
    x[ZEROS], e0[ZEROS] = 0.0, 0.0  # gradients hold exact zeros (unused rows, masked tokens)
    out = {}
    err, ref_err = e0.clone(), e0.clone()
    packed, scale = mod.compress(x.clone(), err)
    want_packed, want_scale = ref.compress(x.clone(), ref_err)
    c = x + e0
    out["feedback"] = {
        "packed": packed.tolist(), "want_packed": want_packed.tolist(), "packed_of_x": ref.pack_signs(x).tolist(),
        "scale": float(scale.reshape(-1)[0]), "want_scale": float(want_scale), "mean_abs": c.abs().mean().item(),
        "max_abs": c.abs().max().item(), "rms_x": (x.norm() / 8).item(),
        "error": _rel(err, ref_err), "error_unchanged": bool(torch.equal(err, e0)),
        "error_negated": _rel(-err, ref_err),
        "error_from_x": _rel(err, x - want_scale * ref.unpack_signs(want_packed)),
        # sign(0) taken as 0 in the error (torch.sign), or as -1 in the signs
        "error_sign0": _rel(err, c - want_scale * c.sign()),
        "packed_zero_negative": ref.pack_signs(torch.where(c > 0, 1.0, -1.0)).tolist()}
    packed, scale = mod.compress(x.clone(), None)
    want_packed, want_scale = ref.compress(x.clone(), None)
    out["none"] = {"packed": packed.tolist() == want_packed.tolist(), "scale": float(scale.reshape(-1)[0]),
                   "want_scale": float(want_scale)}
    return out


def _errors(comm, n, rank=None):
    """Nonzero starting error buffers, rank-dependent: a function that ignores them gives another result."""
    rank = comm.rank if rank is None else rank
    return 0.2 * _vector(30 + rank, n), 0.2 * _vector(40 + rank, n // comm.size)


def _allreduce_input(rank, n):
    x = torch.zeros(n)
    x[:NUMEL] = _vector(20 + rank, NUMEL, shift=0.5 * rank)
    return x


def _one_scale_per_chunk(comm, n):
    """What compressed_allreduce returns when each worker compresses each chunk with a scale of
    its own (the slip), simulated for every rank here (inputs and errors depend on the rank)."""
    from minizero.compression import onebit as ref
    world, chunk = comm.size, n // comm.size

    def decoded(v, error):
        packed, scale = ref.compress(v, error)
        return scale * ref.unpack_signs(packed)
    sent = [[decoded(x_j, e_j) for x_j, e_j in zip(_allreduce_input(r, n).view(world, chunk),
                                                   _errors(comm, n, r)[0].view(world, chunk))]
            for r in range(world)]  # sent[r][j]: worker r's chunk j, decoded
    averages = [torch.stack([sent[r][j] for r in range(world)]).mean(dim=0) for j in range(world)]
    return torch.cat([decoded(a, _errors(comm, n, j)[1]) for j, a in enumerate(averages)])


def allreduce_phase(comm, mod):
    from minizero.compression import onebit as ref
    from minizero_course.experiments.tensor import collective_calls
    n = ref.padded_numel(NUMEL, comm.size)
    x = _allreduce_input(comm.rank, n)
    worker, server = _errors(comm, n)
    ref_worker, ref_server = _errors(comm, n)
    comm.stats.reset()
    got = mod.compressed_allreduce(x.clone(), comm, worker, server)
    calls = collective_calls(comm)
    sent = {op: s["sent_bytes"] for op, s in comm.stats.as_dict().items()}
    want = ref.compressed_allreduce(x.clone(), comm, ref_worker, ref_server)
    everyone = comm.allgather_object(got)
    exact = x.clone()
    comm.all_reduce(exact)
    return {"calls": calls, "sent": sent, "formula": ref.bytes_compressed(NUMEL, comm.size),
            "result": _rel(got, want), "norm_ratio": (got.float().norm() / want.norm()).item() if got.numel() else 0.0,
            "exact": _rel(got, exact / comm.size), "same_everywhere": all(torch.equal(got, o) for o in everyone),
            "per_chunk_scale": _rel(got, _one_scale_per_chunk(comm, n)),
            "worker_error": _rel(worker, ref_worker),
            "worker_unchanged": bool(torch.equal(worker, _errors(comm, n)[0])),
            "server_error": _rel(server, ref_server),
            "server_unchanged": bool(torch.equal(server, _errors(comm, n)[1])),
            "shape": list(got.shape), "want_shape": list(want.shape)}


def feedback_phase(comm, mod):
    from minizero.compression import onebit as ref
    n = ref.padded_numel(NUMEL, comm.size)
    x = torch.zeros(n)
    x[:NUMEL] = _vector(50 + comm.rank, NUMEL, shift=0.5 * comm.rank)
    truth = x.clone()
    comm.all_reduce(truth)
    truth /= comm.size
    worker, server = torch.zeros(n), torch.zeros(n // comm.size)
    total, errors, touched = torch.zeros(n), {}, {}
    for k in range(1, max(FEEDBACK_CALLS) + 1):
        total += mod.compressed_allreduce(x, comm, worker, server)
        if k == 1:
            touched = {"worker": bool(worker.any()), "server": bool(server.any())}
        if k in FEEDBACK_CALLS:
            errors[k] = _rel(total[:NUMEL] / k, truth[:NUMEL])
    return {"errors": errors, "touched": touched}


def adam_phase(comm, mod):
    from minizero.compression import OneBitAdam
    from minizero.data import shard
    from minizero_course.experiments.references import global_batches
    from minizero.models import build_model
    runs = {}
    for name, freeze, impl in (("yours", ADAM_FREEZE, mod.compressed_allreduce), ("reference", ADAM_FREEZE, None),
                               ("Adam", ADAM_STEPS + 1, None)):
        model = build_model("tiny-gpt", seed=0, **ADAM_GPT)
        kwargs = {"allreduce": impl} if impl else {}
        runs[name] = (model, OneBitAdam(model.parameters(), comm, lr=3e-3, freeze_step=freeze, per_tensor=False,
                                        **kwargs), [])
    sent = []
    for batch in global_batches(runs["yours"][0], ADAM_STEPS, 2 * comm.size):
        x, y = shard(batch, comm.rank, comm.size)
        for name, (model, opt, losses) in runs.items():
            loss = model(x, y)[1]
            loss.backward()
            comm.stats.reset()
            opt.step()
            if name == "yours" and opt.steps_done > ADAM_FREEZE:
                sent.append(comm.stats.sent())
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    params = {name: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for name, (m, _, _) in runs.items()}
    return {"params": _rel(params["yours"], params["reference"]),
            "losses": {name: losses for name, (_, _, losses) in runs.items()},
            "sent": sent, "formula": runs["yours"][1].bytes_per_step(True)}


ZO = dict(var_freeze_step=20, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)  # every rule acts
ZO_STEPS = 40


def _trace(policy_cls) -> list:
    """(kind, var_interval, local_interval) after each of steps 1..ZO_STEPS of a fresh policy."""
    policy, out = policy_cls(**ZO), []
    for step in range(1, ZO_STEPS + 1):
        kind = "variance" if policy.variance_step(step) else "sync" if policy.sync_step(step) \
            else "local" if policy.frozen(step) else "1-bit"
        policy.advance(step)
        out.append([kind, policy.var_interval, policy.local_interval])
    return out


def zeroone_phase(comm, mod):
    from minizero.compression import ZeroOneAdam, ZeroOnePolicy
    from minizero.compression.zero_one_adam import bytes_at
    from minizero.data import shard
    from minizero_course.experiments.references import global_batches
    from minizero.models import build_model
    try:  # an untouched stretch task costs the main checks nothing: its stub is recorded, not raised
        out = {"trace": _trace(mod.ZeroOnePolicy), "want_trace": _trace(ZeroOnePolicy)}
    except NotImplementedError as e:  # the same stub on every rank, before any collective
        return {"stub": str(e)}
    if out["trace"] != out["want_trace"]:  # the judge stops at the schedule: no run needed
        return out
    runs = {}
    for name, cls in (("yours", mod.ZeroOneAdam), ("reference", ZeroOneAdam), ("Adam", None)):
        model = build_model("tiny-gpt", seed=0, **ADAM_GPT)
        opt = cls(model.parameters(), comm, lr=1e-3, **ZO) if cls else torch.optim.Adam(model.parameters(), lr=1e-3)
        runs[name] = (model, opt, [])
    sent = []
    for batch in global_batches(runs["yours"][0], ZO_STEPS, 2 * comm.size):
        x, y = shard(batch, comm.rank, comm.size)
        for name, (model, opt, losses) in runs.items():
            loss = model(x, y)[1]
            loss.backward()
            if name == "Adam":  # plain data parallelism: the averaged gradient
                for p in model.parameters():
                    comm.all_reduce(p.grad, op="avg")
            comm.stats.reset()
            opt.step()
            if name == "yours":
                sent.append(comm.stats.sent())
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    numel = sum(p.numel() for p in runs["reference"][0].parameters())
    params = {name: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for name, (m, _, _) in runs.items()}
    everyone = comm.allgather_object(params["yours"])  # local steps: equal after a sync up to rounding
    return {**out, "sent": sent, "formula": [bytes_at(kind, numel, comm.size) for kind, _, _ in out["want_trace"]],
            "params": _rel(params["yours"], params["reference"]),
            "same_everywhere": all(_rel(o, params["yours"]) <= RTOL for o in everyone),
            "losses": {name: losses for name, (_, _, losses) in runs.items()}}


PHASES = {"compress": compress_phase, "allreduce": allreduce_phase, "feedback": feedback_phase, "adam": adam_phase,
          "zeroone": zeroone_phase}
MAIN = ("compress", "allreduce", "feedback", "adam")  # the stretch task's phase runs in its own launch


def measure_worker(comm, impls: list[str], phases=tuple(PHASES)) -> dict:
    """{impl: {phase: result}} for each file, for the phases asked."""
    return measure_phases(comm, impls, PHASES, phases)


def measured(impl: str, phases=MAIN) -> list:
    """One 4-rank run per file, shared by the checks (a stub's error is shared too)."""
    results = launched_once("minizero_course.grader.lab13:measure_worker", 4, {"impls": [impl], "phases": list(phases)},
                            300)
    return [r[impl] for r in results]


# ------------------------------------------------------------------------------ the judges
def judge_compress(results) -> str:
    r = first_phase(results, "compress")[0]  # the same on every rank: no collective
    f = r["feedback"]
    if f["packed"] == f["packed_of_x"] and f["packed"] != f["want_packed"]:
        raise CheckFailed("compress: the signs are those of x alone: the error was not added, compress c = x + error")
    if f["packed"] != f["want_packed"]:
        if f["packed"] == f["packed_zero_negative"]:
            raise CheckFailed(f"compress: the elements where c = 0 (positions {ZEROS}) were packed "
                              "as -1: sign(0) must be +1: the 1-bit code has no zero, and the "
                              "reference sends c >= 0 as +1 (pack_signs(c) as it is)")
        raise CheckFailed("compress: the packed signs differ from pack_signs(x + error)")
    if abs(f["scale"] - f["want_scale"]) > RTOL * f["want_scale"]:
        named = {"mean_abs": "the mean of |c|", "max_abs": "the largest |c|", "rms_x": "the RMS of x without the error"}
        which = next((words for key, words in named.items() if abs(f["scale"] - f[key]) <= RTOL * f[key]), None)
        raise CheckFailed(f"compress: scale {f['scale']:.6g}, expected {f['want_scale']:.6g}"
                          + (f" (yours is {which})" if which else "")
                          + ": the scale is the RMS of c, ||c|| / sqrt(numel), so scale * signs keeps c's norm")
    if f["error"] > RTOL:
        if f["error_unchanged"]:
            why = "the error buffer was not updated in place (error.copy_(...), not a new tensor)"
        elif f["error_negated"] <= RTOL:
            why = "it is the negative of what was lost: error = c - scale * signs"
        elif f["error_from_x"] <= RTOL:
            why = "it was computed from x instead of c = x + error: error = c - scale * signs"
        elif f["error_sign0"] <= RTOL:
            why = (f"where c = 0 (positions {ZEROS}) it kept 0, as if sign(0) were 0 "
                   "(torch.sign): sign(0) must be +1: the 1-bit code has no zero, the receiver "
                   "decodes every element as +scale or -scale, so at c = 0 it gets +scale and the "
                   "error must be -scale; a 0 there drops what was lost from the error feedback "
                   "(use unpack_signs(packed), the values the receiver decodes)")
        else:
            why = "error must become c - scale * signs, what this compression lost"
        raise CheckFailed(f"compress: the error buffer after the call is wrong: {why}")
    n = r["none"]
    if not n["packed"] or abs(n["scale"] - n["want_scale"]) > RTOL * n["want_scale"]:
        raise CheckFailed("compress(x, None): without an error buffer, compress x alone (signs of x, its RMS)")
    return "signs, RMS scale and the error fed back equal the reference's, with and without an error buffer"


def judge_allreduce(results) -> str:
    for rank, r in enumerate(first_phase(results, "allreduce")):
        if r["calls"] != {"all_to_all": 1, "all_gather": 1}:
            raise CheckFailed(f"rank {rank}: compressed_allreduce ran {_ops(r['calls'])}, expected 1 all_to_all (chunk "
                              "j of the signs to rank j) and 1 all_gather (every server's chunk to everyone)")
        for op, sent in r["sent"].items():
            if abs(sent - r["formula"] / 2) > 1e-6:
                raise CheckFailed(f"rank {rank}: the {op} sent {sent:.0f} B, expected (N-1)/N (n/8 + 4N) = "
                                  f"{r['formula'] / 2:.0f} B: 1 bit per element and one fp32 scale per chunk "
                                  "(send _message(packed, scale) bytes, not fp32 values)")
        if r["shape"] != r["want_shape"]:
            raise CheckFailed(f"rank {rank}: the result has shape {r['shape']}, expected {r['want_shape']} (the whole "
                              "padded x: every rank's chunk, decoded)")
        if not r["same_everywhere"]:
            raise CheckFailed("the result differs between ranks: every rank must decode the same all-gathered chunks")
        if r["result"] > RTOL:
            if abs(r["norm_ratio"] / len(results) - 1) < 0.25:
                why = (f"it is about N times as large ({r['norm_ratio']:.2f}x): the server must average the N decoded "
                       "chunks, not sum them")
            elif r["exact"] <= RTOL:
                why = "it is the exact average: nothing was compressed"
            elif r["worker_error"] > RTOL and r["worker_unchanged"]:
                why = "the worker error was not used (compress x with worker_error)"
            elif r["server_error"] > RTOL and r["server_unchanged"]:
                why = "the server error was not used (compress the average with server_error)"
            elif r["per_chunk_scale"] <= RTOL:
                why = ("the worker compressed each chunk with its own scale: it compresses all "
                       "of x once (one scale, the RMS of x + worker_error over every element) and "
                       "sends that one scale with each chunk")
            else:
                why = "chunk j of the signs goes to rank j, which averages the N chunks it gets and compresses that"
            raise CheckFailed(f"rank {rank}: the result differs from the reference (relative {r['result']:.3g}): {why}")
        for side in ("worker", "server"):
            if r[f"{side}_error"] > RTOL:
                raise CheckFailed(f"rank {rank}: the {side} error after the call differs from the reference's"
                                  + (" (it was not updated)" if r[f"{side}_unchanged"] else ""))
    return ("1 all-to-all + 1 all-gather, bytes = 2 (N-1)/N (n/8 + 4N); result and both errors equal the "
            "reference's (4 ranks, 1001 elements padded to 1024, nonzero starting errors)")


def judge_feedback(results) -> str:
    r = first_phase(results, "feedback")[0]
    errs = r["errors"]
    last, first = errs[str(max(FEEDBACK_CALLS))], errs["1"]
    for side in ("worker", "server"):
        if not r["touched"][side]:
            raise CheckFailed(f"the {side} error buffer is still zeros after a call: without {side}-side error "
                              f"feedback the running mean of {max(FEEDBACK_CALLS)} calls stays {last:.3f} away from "
                              "the true mean (relative): the rounding is a bias")
    if not last < 0.05:
        raise CheckFailed(f"the running mean of {max(FEEDBACK_CALLS)} compressed all-reduces of the same vectors is "
                          f"{last:.3f} (relative) from the true mean, expected < 0.05: error feedback carries what "
                          "each call lost into the next")
    return (f"running mean of the compressed all-reduce -> the true mean: relative error {first:.3f} after 1 call, "
            f"{errs['10']:.3f} after 10, {last:.4f} after {max(FEEDBACK_CALLS)}")


def judge_adam(results) -> str:
    r = first_phase(results, "adam")[0]
    if r["params"] > 1e-4:
        raise CheckFailed(f"OneBitAdam with your all-reduce ends {r['params']:.3g} (relative) from the reference's "
                          f"after {ADAM_STEPS} steps ({ADAM_STEPS - ADAM_FREEZE} compressed)")
    for step, sent in enumerate(r["sent"], ADAM_FREEZE + 1):
        if abs(sent - r["formula"]) > 1e-6:
            raise CheckFailed(f"compressed step {step} sent {sent:.0f} B, expected {r['formula']:.0f} B")
    mine, adam = r["losses"]["yours"], r["losses"]["Adam"]
    if not mine[-1] < mine[ADAM_FREEZE] or not abs(mine[-1] - adam[-1]) < 0.5:
        raise CheckFailed(f"after {ADAM_STEPS} steps the loss is {mine[-1]:.3f} "
                          f"(at the freeze {mine[ADAM_FREEZE]:.3f}), plain Adam's {adam[-1]:.3f}")
    return (f"OneBitAdam with your all-reduce equals the reference's; loss {mine[ADAM_FREEZE]:.3f} -> "
            f"{mine[-1]:.3f} over {ADAM_STEPS - ADAM_FREEZE} compressed steps (plain Adam {adam[-1]:.3f}), "
            f"{r['formula']:.0f} B a step")


def judge_zeroone(results) -> str:
    r = first_phase(results, "zeroone")[0]
    if "stub" in r:
        raise CheckFailed(r["stub"])
    mine, want = r["trace"], r["want_trace"]
    if mine != want:
        step = next(i for i, (a, b) in enumerate(zip(mine, want)) if a != b) + 1
        var, local = [t[1] for t in mine], [t[2] for t in mine]
        frozen = ZO["var_freeze_step"]
        if any(v & (v - 1) for v in var):
            why = "var_interval must double (x2) after var_update_scaler variance steps, not grow by one"
        elif max(var) < max(t[1] for t in want) and var[:frozen].count(2) > frozen // 2:
            why = "var_interval doubled once and stopped: var_counter must start again from 0 after each doubling"
        elif var[:frozen] != (want_var := [t[1] for t in want])[:frozen]:
            at = next(s for s in range(frozen) if var[s] != want_var[s])  # after step at + 1
            if var[at] > want_var[at]:
                why = (f"var_interval doubled too early (after step {at + 1} it is {var[at]}, "
                       f"expected {want_var[at]}): var_counter counts only the variance steps "
                       "(step % var_interval == 0), not every step")
            else:
                late = "one step" if var[at + 1:at + 2] == want_var[at:at + 1] else "too"
                why = (f"var_interval doubled {late} late (after step {at + 1} it is still "
                       f"{var[at]}, expected {want_var[at]}): double it in advance(step) as soon "
                       "as the var_update_scaler-th variance step is counted, so that the very "
                       "next step reads the new interval")
        elif max(local) > ZO["local_step_clipper"]:
            why = f"local_interval grew past local_step_clipper ({ZO['local_step_clipper']}): clip it with min()"
        elif local[frozen:] != [t[2] for t in want][frozen:]:
            why = ("local_interval doubled at the wrong steps: it doubles after every local_step_scaler "
                   f"({ZO['local_step_scaler']}) frozen steps, the counter starting again from 0")
        else:
            why = "what each step does differs"
        raise CheckFailed(f"ZeroOnePolicy ({', '.join(f'{k} {v}' for k, v in ZO.items())}): step {step} is "
                          f"{mine[step - 1]} (kind, var_interval, local_interval after it), expected "
                          f"{want[step - 1]}: {why}")
    for step, (sent, formula) in enumerate(zip(r["sent"], r["formula"]), 1):
        if abs(sent - formula) > 1e-6:
            raise CheckFailed(f"ZeroOneAdam step {step} ({want[step - 1][0]}) sent {sent:.0f} B, expected "
                              f"{formula:.0f} B")
    if not r["same_everywhere"] or r["params"] > 1e-4:
        raise CheckFailed(f"ZeroOneAdam with your policy ends {r['params']:.3g} (relative) from the reference's after "
                          f"{ZO_STEPS} steps" + ("" if r["same_everywhere"] else "; the ranks' parameters differ"))
    ours, adam = r["losses"]["yours"], r["losses"]["Adam"]
    if not ours[-1] < ours[0] or not abs(ours[-1] - adam[-1]) < 0.5:
        raise CheckFailed(f"ZeroOneAdam's loss {ours[0]:.3f} -> {ours[-1]:.3f} over {ZO_STEPS} steps, plain Adam's "
                          f"{adam[-1]:.3f}")
    kinds = [t[0] for t in want]
    return (f"0/1 Adam's schedule equals the reference's ({kinds.count('variance')} variance, {kinds.count('1-bit')} "
            f"1-bit, {kinds.count('local')} local, {kinds.count('sync')} sync steps of {ZO_STEPS}); "
            f"{sum(r['sent']):.0f} B sent against Adam's {ZO_STEPS * r['formula'][0]:.0f}; loss {ours[0]:.3f} -> "
            f"{ours[-1]:.3f} (Adam {adam[-1]:.3f})")


CHECKS = [
    Check("compress: signs, RMS scale, error fed back", 3, judged_check(judge_compress, measured)),
    Check("compressed_allreduce: 1-bit all-to-all + all-gather, equal to the reference, bytes", 3,
          judged_check(judge_allreduce, measured)),
    Check("error feedback: the running mean converges", 2, judged_check(judge_feedback, measured)),
    Check("OneBitAdam with your all-reduce: the reference's result, against plain Adam", 2,
          judged_check(judge_adam, measured)),
    Check("stretch: 0/1 Adam's adaptive variance freezing and local steps", 2,
          judged_check(judge_zeroone, measured, ("zeroone",)), extra=True),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab13_onebit.py` shows."""
    res = feedback_phase(comm, impl)
    cut = allreduce_phase(comm, impl)
    if comm.rank:
        return
    print(f"\ncompressed all-reduce of {NUMEL} elements on {comm.size} ranks: {_ops(cut['calls'])}, "
          f"{sum(cut['sent'].values()):.0f} B sent (formula {cut['formula']:.0f}; fp32 all-reduce "
          f"{2 * (comm.size - 1) / comm.size * 4 * NUMEL:.0f})")
    print(f"result against the reference: relative {cut['result']:.2e}")
    for k, err in res["errors"].items():
        print(f"  running mean after {k:>3} calls: {err:.4f} from the true mean (relative)")
