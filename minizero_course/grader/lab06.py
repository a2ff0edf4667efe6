"""Lab 06 checks: your ZeRO-3 gather / free / reduce-scatter hooks train exactly like DDP, hold
only the shards between units, send 1.5x DDP's bytes, and prefetch: the next unit's all-gather
is in flight while this one computes (seen through the communicator's handles).

One job per N runs the student's FSDP and our DDP side by side (same batches, same SGD) and
reports what it measured; the four checks read that report (cached: each N launches once)."""
import weakref

import torch
import torch.nn as nn

from minizero import memory
from minizero_course.grader import Check, CheckFailed, Lab
from minizero_course.grader.hints import update_size_cause
from minizero.comm import ring_bytes_sent

LAB = Lab(6, "zero3", "ZeRO-3 / FSDP: gather and free hooks", "minizero/zero/fsdp.py")

GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
# (model config, wrap, persistence_threshold). edge: a weight tied across units, and the biases
# and the unused parameter (< 14 elements) kept whole: each unit's buffer is [sharded | persistent].
MODELS = {"tiny-gpt": (GPT, None, 0), "edge": ({}, (nn.Linear,), 14)}
STEPS, BATCH, LR = 4, 12, 0.1
ATOL = 2e-7  # at rtol 1e-6: fp32 SGD, only the order of additions differs (see tests/test_zero3.py)


def worker(comm, impl):
    """On every rank: the student's FSDP and minizero's DDP, step by step."""
    from minizero.data import shard
    from minizero.dp.ddp import DDP
    from minizero.launch import load_target
    from minizero.models import build_model
    from minizero_course.experiments.references import global_batches
    from minizero_course.experiments.timed_comm import TimedComm
    FSDP = load_target(impl + ":FSDP")
    torch.set_num_threads(1)
    out = {}
    for name, (cfg, wrap, persist) in MODELS.items():
        ref = build_model(name, seed=0, **cfg)
        ddp = DDP(ref, comm)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
        timed = TimedComm(comm, lambda: 0)  # only to see which all-gathers are in flight, and when
        fsdp = FSDP(build_model(name, seed=0, **cfg), timed, wrap=wrap, persistence_threshold=persist)
        opt = torch.optim.SGD(fsdp.parameters(), lr=LR, momentum=0.9)
        shard_bytes = sum(4 * u.layout.shard_numel + 4 * u.persistent_numel for u in fsdp.units)
        frozen = sum(4 * p.numel() for p in fsdp.module.parameters() if not p.requires_grad)
        gathered = []  # a weakref to each buffer gathered in forward: is it really freed?
        in_flight = {}  # unit -> all-gathers in flight right after its forward (registered after FSDP's hooks)
        for u in fsdp.units:
            u.module.register_forward_pre_hook(lambda m, a, u=u: gathered.append(weakref.ref(u.buf)))
            u.module.register_forward_hook(lambda m, a, o, u=u: in_flight.__setitem__(
                u.name, len(timed.in_flight("all_gather"))))
        facts = {"shard_bytes": shard_bytes + frozen, "padded": sum(u.gathered_numel for u in fsdp.units),
                 "persistent": [u.persistent_numel for u in fsdp.units if u.persistent_numel], "steps": [],
                 "buffer_bytes": sum(b.numel() * b.element_size() for b in fsdp.module.buffers())}
        for step, batch in enumerate(global_batches(ref, STEPS, BATCH)):
            x, y = shard(batch, comm.rank, comm.size)
            before = ({n: p.detach().clone() for n, p in ref.state_dict().items()}, fsdp.gather_full_params())
            comm.stats.reset()
            ddp(x, y)[1].backward()
            ddp.finish_gradient_synchronization()
            ddp_sent = comm.stats.sent()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)

            comm.stats.reset()
            memory.transient.reset()
            gathered.clear()
            timed.records.clear()
            loss = fsdp(x, y)[1]
            after_forward = memory.measure(fsdp).by_category["parameters"]
            alive = sum(r() is not None for r in gathered)
            loss.backward()
            sent = {op: s["sent_bytes"] for op, s in comm.stats.as_dict().items()}
            handles = {"blocking_gathers": sum(not r["async"] for r in timed.records if r["op"] == "all_gather"),
                       "never_waited": [r["op"] for r in timed.in_flight()]}
            opt.step()
            opt.zero_grad(set_to_none=True)
            full = fsdp.gather_full_params()
            worst = max(((n, ((full[n] - p).abs() - 1e-6 * p.abs()).max().item())
                         for n, p in ref.state_dict().items() if n in full), key=lambda t: t[1])
            moved = [sum(((now[n] - was[n]).float() ** 2).sum().item() for n in full if n in before[0]) ** 0.5
                     for now, was in ((full, before[1]), (ref.state_dict(), before[0]))]
            facts["steps"].append({
                "ddp_sent": ddp_sent, "sent": sent, "after_forward": after_forward, "alive": alive,
                "after_step": memory.measure(fsdp, opt).by_category["parameters"],
                "live_after_step": memory.transient.current, "peak": memory.transient.peak,
                "worst": worst, "loss": loss.item(), "in_flight_after_forward": dict(in_flight), **handles,
                "update_ratio": moved[0] / moved[1] if moved[1] else float("nan")})
        out[name] = facts
    return out


_cache = {}


def _results(impl, n):
    """One launch per (impl, N), shared by the checks; a failure is re-raised to each of them."""
    from minizero import launch
    if (impl, n) not in _cache:
        try:
            _cache[impl, n] = launch.run("minizero_course.grader.lab06:worker", nprocs=n, args={"impl": impl},
                                         timeout=180)
        except Exception as e:  # noqa: BLE001  (the grader reports it; see grader.run_check)
            _cache[impl, n] = e
    if isinstance(_cache[impl, n], Exception):
        raise _cache[impl, n]
    return _cache[impl, n]


def check_matches_ddp(impl):
    lines = []
    for n in (3, 4):
        for rank, res in enumerate(_results(impl, n)):
            for name, facts in res.items():
                for step, s in enumerate(facts["steps"]):
                    param, excess = s["worst"]
                    if excess > ATOL:
                        raise CheckFailed(f"N={n}, {name}: rank {rank} parameter `{param}` differs from DDP after step "
                                          f"{step} (|diff| exceeds rtol 1e-6 by {excess:.2g}, allowed {ATOL:g})."
                                          + update_size_cause(s["update_ratio"], n))
        worst = max(s["worst"][1] for res in _results(impl, n) for f in res.values() for s in f["steps"])
        lines.append(f"N={n}: tied GPT and edge model match DDP for {STEPS} SGD steps "
                     f"(worst excess over rtol 1e-6: {max(worst, 0):.1e})")
    return "\n".join(lines)


def check_memory(impl):
    n = 4
    for rank, res in enumerate(_results(impl, n)):
        for name, facts in res.items():
            want = facts["shard_bytes"]
            for step, s in enumerate(facts["steps"]):
                where = f"N={n}, {name}, rank {rank}, step {step}"
                if s["alive"]:
                    raise CheckFailed(f"{where}: {s['alive']} gathered buffer(s) still alive after forward: something "
                                      "still references them (u.buf after _free, or the module attributes: "
                                      "_post_forward must _install(u, None))")
                if s["after_forward"] > want:
                    raise CheckFailed(f"{where}: parameters after forward {s['after_forward']} B, expected <= {want} B "
                                      "(only the shards): a gathered unit was not freed")
                if s["after_step"] > want:
                    raise CheckFailed(f"{where}: parameters after the step {s['after_step']} B, expected <= {want} B")
                if s["live_after_step"]:
                    raise CheckFailed(f"{where}: memory.transient still holds {s['live_after_step']} B after the step: "
                                      "every transient.alloc needs its transient.free")
    gpt = _results(impl, n)[0]["tiny-gpt"]
    return (f"N={n}: parameters per rank = {gpt['shard_bytes']} B (the shards), nothing gathered between units or "
            f"steps; transient peak {gpt['steps'][-1]['peak']} B")


def check_bytes(impl):
    n = 4
    for rank, res in enumerate(_results(impl, n)):
        for name, facts in res.items():
            padded = facts["padded"] * 4
            want = {"all_gather": 2 * ring_bytes_sent("all_gather", padded, n),
                    "reduce_scatter": ring_bytes_sent("reduce_scatter", padded, n)}
            for numel in facts["persistent"]:  # kept whole: their gradients are all-reduced, unit by unit
                want["all_reduce"] = want.get("all_reduce", 0) + ring_bytes_sent("all_reduce", 4 * numel, n)
            if facts["buffer_bytes"]:  # rank 0's buffers before each forward, as torch DDP
                want["broadcast"] = ring_bytes_sent("broadcast", facts["buffer_bytes"], n)
            for step, s in enumerate(facts["steps"]):
                got = {op: b for op, b in s["sent"].items() if b}
                if got.keys() != want.keys() or any(abs(got[op] - want[op]) > 1e-6 for op in want):
                    raise CheckFailed(f"N={n}, {name}, rank {rank}, step {step}: sent {got}, expected {want} "
                                      "(all-gather in forward and again in backward, one reduce-scatter; "
                                      "the persistent parameters' gradients all-reduced)")
    s = _results(impl, n)[0]["tiny-gpt"]["steps"][-1]
    total = sum(s["sent"].values())
    return f"N={n}: {total:.0f} B per rank per step = {total / s['ddp_sent']:.4f} x DDP's {s['ddp_sent']:.0f} B"


def check_prefetch(impl):
    """Prefetch, seen through the communicator's handles (experiments.timed_comm): right after a
    unit's forward, the next unit's all-gather must be in flight (issued async, not yet waited)."""
    n = 4
    for rank, res in enumerate(_results(impl, n)):
        for name, facts in res.items():
            for step, s in enumerate(facts["steps"]):
                where = f"N={n}, {name}, rank {rank}, step {step}"
                if s["never_waited"]:
                    raise CheckFailed(f"{where}: {len(s['never_waited'])} {s['never_waited'][0]}(s) never waited for: "
                                      "wait() on each gather's handle before its buffer is used")
                if s["blocking_gathers"]:
                    raise CheckFailed(f"{where}: {s['blocking_gathers']} all-gathers were blocking (async_op=False), "
                                      "so a prefetch is done before the unit that issued it computes: nothing "
                                      "overlaps. Issue them with async_op=True and keep the handle in unit.work")
                if not any(s["in_flight_after_forward"].values()):
                    raise CheckFailed(f"{where}: after each unit's forward ({s['in_flight_after_forward']}) no "
                                      "all-gather was in flight: the prefetched unit was waited for at once. Keep its "
                                      "handle in unit.work; _wait waits when the unit is needed")
    s = _results(impl, n)[0]["tiny-gpt"]["steps"][-1]
    return (f"N={n}: all-gathers in flight right after each unit's forward (tiny-gpt, rank 0): "
            f"{s['in_flight_after_forward']}; every handle waited")


CHECKS = [
    Check("trains like DDP (tied GPT, edge model; N=3, 4)", 5, check_matches_ddp),
    Check("only the shards stay in memory; nothing left gathered", 3, check_memory),
    Check("bytes per step = 3(N-1)/N * padded Psi * 4 = 1.5x DDP", 2, check_bytes),
    Check("prefetch: the next unit's all-gather is in flight while this one computes", 2, check_prefetch),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab06_zero3.py` shows."""
    out = _demo_run(comm, impl.FSDP)
    rows = comm.allgather_object(out)
    if comm.rank == 0:
        r0 = rows[0]
        print(f"TinyGPT {r0['psi']} parameters, {comm.size} ranks, SGD; your FSDP vs minizero DDP")
        for step, (a, b) in enumerate(zip(r0["loss"], r0["ddp_loss"])):
            print(f"  step {step}: rank 0 loss {a:.6f}  (DDP {b:.6f})")
        print(f"  max |param - DDP| after {len(r0['loss'])} steps: {r0['max_diff']:.2e}")
        print("memory per rank (ledger, bytes):")
        for rank, r in enumerate(rows):
            print(f"  rank {rank}: parameters {r['ledger']['parameters']}, gradients {r['ledger']['gradients']}, "
                  f"optimizer {r['ledger']['optimizer_state']}; transient peak {r['peak']}  "
                  f"(DDP total {r['ddp_total']})")
        print(f"bytes sent per rank per step: {r0['sent']:.0f} = {r0['sent'] / max(r0['ddp_sent'], 1):.3f} x DDP's "
              f"{r0['ddp_sent']:.0f}")


def _demo_run(comm, FSDP, steps=5):
    from minizero.data import shard
    from minizero.dp.ddp import DDP
    from minizero.models import build_model
    from minizero_course.experiments.references import flat_params, global_batches
    ref = build_model("tiny-gpt", seed=0, **GPT)
    ddp = DDP(ref, comm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    fsdp = FSDP(build_model("tiny-gpt", seed=0, **GPT), comm)
    opt = torch.optim.SGD(fsdp.parameters(), lr=LR, momentum=0.9)
    out = {"loss": [], "ddp_loss": [], "psi": ref.num_params()}
    for batch in global_batches(ref, steps, BATCH):
        x, y = shard(batch, comm.rank, comm.size)
        comm.stats.reset()
        loss = ddp(x, y)[1]
        loss.backward()
        ddp.finish_gradient_synchronization()
        out["ddp_sent"] = comm.stats.sent()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        out["ddp_loss"].append(loss.item())
        comm.stats.reset()
        memory.transient.reset()
        loss = fsdp(x, y)[1]
        loss.backward()
        out["sent"] = comm.stats.sent()
        out["peak"] = memory.transient.peak
        opt.step()
        out["ledger"] = memory.measure(fsdp, opt).by_category
        opt.zero_grad(set_to_none=True)
        out["loss"].append(loss.item())
    full = fsdp.gather_full_params()
    names = {id(p): n for n, p in ref.named_parameters()}
    mine = torch.cat([full[names[id(p)]].reshape(-1) for p in ref.parameters()])
    out["max_diff"] = (mine - flat_params(ref)).abs().max().item()
    out["ddp_total"] = memory.measure(ddp, ref_opt).total
    return out
