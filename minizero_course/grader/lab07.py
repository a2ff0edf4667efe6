"""Lab 07 checks: your offloaded step (HostOptimizer.grads_to_host, cpu_step, params_to_device in
minizero/zero/offload.py) trains ZeRO-2 like DDP, works on several device tensors at once (ZeRO-3's
shape: a shard per unit) in fp32, fp16 and bf16, keeps the master copy, the gradients and the
optimizer state on the host, and moves exactly 2 + 2 bytes per shard element in 16 bits.

One 2-rank job per submission runs the harness of lesson 07 (minizero_course.experiments.offload.
side_by_side) in fp32 and fp16, and on each rank drives the three methods directly on three device
tensors (views into one flat buffer, as a model's weights are), gradients given, each method's
effect observed on its own; the checks read its report. Stretch task (extra points): the delayed
parameter update's thread in step(), driven with DPU on and the delayed step held at a gate while
the next gradients come down, so that a race is a certainty."""
import copy

import torch

from minizero_course.grader import Check, CheckFailed, Lab

LAB = Lab(7, "offload", "ZeRO-Offload: gradients down, CPU step, parameters up", "minizero/zero/offload.py")
N, STEPS = 2, 4
LR, MOMENTUM = 0.1, 0.9  # the probes' SGD
ATOL = 2e-7  # at rtol 1e-6: fp32 SGD, the same float operations as DDP up to the order of additions


def worker(comm, impl):
    from minizero_course.experiments.offload import side_by_side
    from minizero.launch import load_target
    torch.set_num_threads(1)
    HostOptimizer = load_target(impl + ":HostOptimizer")
    out = {"fp32": side_by_side(comm, HostOptimizer, STEPS),
           "fp16": side_by_side(comm, HostOptimizer, 2, dtype=torch.float16),
           "tiers": {name: tier_probe(HostOptimizer, dtype) for name, dtype in DTYPES.items()}}
    try:  # the stretch task: its stub must not cost the main checks anything
        out["dpu"] = dpu_probe(HostOptimizer)
    except NotImplementedError as e:
        out["dpu"] = {"stub": str(e)}
    return out


SIZES = (5, 13, 1)          # ZeRO-3-shaped: several flat shards per tier (one per unit), odd sizes
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PROBE_STEPS = 3


def _sgd(params):
    """torch SGD with momentum as the tier builds it (fused on the CPU: the same arithmetic)."""
    from minizero.zero.offload import cpu_optimizer
    return cpu_optimizer(torch.optim.SGD, params, lr=LR, momentum=MOMENTUM)


def _reference(device):
    params = [p.detach().float().clone().requires_grad_() for p in device]
    return params, _sgd(params)


def _ref_step(params, opt, grads):
    for p, g in zip(params, grads):
        p.grad = g.reshape(-1).float().clone()
    opt.step()
    return [p.detach().clone() for p in params]


def _fork(params, opt):
    """A copy of the reference optimizer and its parameters (to ask: what if the step used zeros?)."""
    twin = [p.detach().clone().requires_grad_() for p in params]
    twin_opt = _sgd(twin)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (loading keeps the same momentum tensors otherwise)
    return twin, twin_opt


def _close(a, b):
    return bool(((a.float() - b.float()).abs() <= 1e-6 * b.float().abs() + 1e-7).all())


def tier_probe(HostOptimizer, dtype, seed=7):
    """The lab's three methods driven directly on several device tensors of `dtype` (views into one
    flat buffer, as a model's weights view theirs), gradients given: what each method did."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(sum(SIZES), generator=gen).to(dtype)
    device = list(flat.split(SIZES))
    ptrs = [p.data_ptr() for p in device]
    grads = [[torch.randn(n, generator=gen).to(dtype) for n in SIZES] for _ in range(PROBE_STEPS)]
    ref, ref_opt = _reference(device)
    host = HostOptimizer(device, torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    buffers = [g.data_ptr() for g in host.grads]
    steps = []
    for t in range(PROBE_STEPS):
        host.traffic.reset()
        exact = [g.reshape(-1).float() for g in grads[t]]
        device_grads = [g.clone() for g in grads[t]]
        host.grads_to_host(grads[t])
        s = {"to_host": host.traffic.to_host, "last_bytes": grads[t][-1].numel() * grads[t][-1].element_size(),
             "device_grads_written": any(not torch.equal(g, d) for g, d in zip(grads[t], device_grads)),
             "host_exact": all(torch.equal(h, e) for h, e in zip(host.grads, exact)),
             "host_via_fp16": all(torch.equal(h, e.half().float()) for h, e in zip(host.grads, exact)),
             "host_untouched": all(not h.any() for h in host.grads),
             "buffers_kept": [g.data_ptr() for g in host.grads] == buffers}
        given = [h.clone() for h in host.grads]  # the step gets its gradients as an argument: what it must use
        for h in host.grads:
            h.zero_()                            # ... while self.grads is already the next backward's (DPU)
        twin, twin_opt = _fork(ref, ref_opt)
        want = _ref_step(ref, ref_opt, exact)
        with_zeros = _ref_step(twin, twin_opt, [torch.zeros_like(e) for e in exact])
        before = [m.clone() for m in host.masters]
        host.cpu_step(given)
        s.update({"moved": [not torch.equal(b, m) for b, m in zip(before, host.masters)],
                  "masters_right": all(_close(m, w) for m, w in zip(host.masters, want)),
                  "stepped_self_grads": all(_close(m, w) for m, w in zip(host.masters, with_zeros)),
                  "grad_on_buffers": any(getattr(g, "grad", None) is not None for g in given),
                  "grad_left": any(m.grad is not None for m in host.masters)})
        stepped = [m.clone() for m in host.masters]
        host.params_to_device()
        s.update({"to_device": host.traffic.to_device,
                  "device_kept": [p.data_ptr() for p in host.device_params] == ptrs,
                  "masters_written": any(not torch.equal(m, k) for m, k in zip(host.masters, stepped)),
                  "flat_right": torch.equal(flat, torch.cat(stepped).to(dtype)),
                  "aliases_master": any(p.untyped_storage().data_ptr() == m.untyped_storage().data_ptr()
                                        for p, m in zip(host.device_params, host.masters))})
        steps.append(s)
        host.zero_grad()
    return {"numel": sum(SIZES), "element_size": flat.element_size(), "steps": steps}


def dpu_probe(HostOptimizer, dtype=torch.float16, seed=8):
    """The stretch task: step() with DPU from step 1 on, the next step's gradients copied down while
    the delayed step is held at a gate, so a race is a certainty, not a chance."""
    import threading
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(sum(SIZES), generator=gen).to(dtype)
    device = list(flat.split(SIZES))
    grads = [[torch.randn(n, generator=gen).to(dtype) for n in SIZES] for _ in range(PROBE_STEPS + 1)]
    ref, ref_opt = _reference(device)
    after = [[p.detach().clone() for p in ref]]
    for t in range(PROBE_STEPS):
        after.append(_ref_step(ref, ref_opt, grads[t]))
    host = HostOptimizer(device, torch.optim.SGD, dpu_warmup_steps=1, lr=LR, momentum=MOMENTUM)
    real, threads, gate = host.cpu_step, [], threading.Event()
    returned, overlapped, copied_up_on_main = [0], [], []

    def held(grads_):  # the delayed step waits until the next gradients are on the host
        on_main = threading.current_thread() is threading.main_thread()
        call = len(threads)
        threads.append(on_main)
        if not on_main:
            gate.wait(timeout=2)
            overlapped.append(returned[0] > call)  # did step() return while this step was held?
        return real(grads_)
    host.cpu_step = held
    up = host.params_to_device

    def noted_up():
        copied_up_on_main.append(threading.current_thread() is threading.main_thread())
        return up()
    host.params_to_device = noted_up
    seen, buffers = [], []  # buffers: every host gradient tensor self.grads held (kept alive: ids stay unique)
    host.grads_to_host(grads[0])
    for t in range(PROBE_STEPS):
        gate.clear()
        host.step()
        returned[0] += 1
        buffers += [g for g in host.grads if not any(g is b for b in buffers)]
        now = torch.cat([p.reshape(-1).float() for p in host.device_params])
        seen.append(next((k for k, a in enumerate(after) if torch.equal(now, torch.cat(a).to(dtype).float())), -1))
        host.zero_grad()
        host.grads_to_host(grads[t + 1])  # the next backward's gradients, while step t may be in flight
        gate.set()
    host.finish()
    final = torch.equal(torch.cat([p.reshape(-1) for p in host.device_params]), torch.cat(after[-1]).to(dtype))
    return {"main_thread": threads, "device_after_step": seen, "final_right": final, "overlapped": overlapped,
            "copied_up_on_main": copied_up_on_main, "gradient_buffers": len(buffers), "per_buffer": len(SIZES),
            "masters_right": all(_close(m, w) for m, w in zip(host.masters, after[-1]))}


_cache = {}


def _results(impl):
    from minizero import launch
    if impl not in _cache:
        try:
            _cache[impl] = launch.run("minizero_course.grader.lab07:worker", nprocs=N, args={"impl": impl}, timeout=180)
        except Exception as e:  # noqa: BLE001  (the grader reports it; see grader.run_check)
            _cache[impl] = e
    if isinstance(_cache[impl], Exception):
        raise _cache[impl]
    return _cache[impl]


# A method that runs its copy the wrong way (the zip's two lists swapped, or copy_'s two
# tensors), as the per-method probe (tier_probe) sees it. The training run only sees its effect
# further on (masters that do not move), so every check that meets it names the method instead.
WRONG_WAY = {
    "device_grads_written": (
        "grads_to_host wrote INTO the device gradients (the copy runs the wrong way: host and "
        "device swapped, in the zip or in copy_): copy from each device gradient into its host "
        "buffer, host.copy_(device gradient)"),
    "grad_on_buffers": (
        "cpu_step gave the gradient buffers a .grad (the masters as their gradient): the masters "
        "are what the optimizer steps, each gets its buffer as .grad (zip(self.masters, grads), "
        "in that order)"),
    "masters_written": (
        "params_to_device wrote INTO the host masters (the copy runs the wrong way: masters and "
        "device tensors swapped, in the zip or in copy_), so the step just taken is lost: copy "
        "each master into its device tensor"),
}


def _wrong_way(res) -> str:
    """WRONG_WAY's words for the first method the probe saw copy the wrong way, else ''."""
    for probe in res["tiers"].values():
        for s in probe["steps"]:
            for flag, words in WRONG_WAY.items():
                if s[flag]:
                    return words
    return ""


def _broken_part(rank, r):
    """The first part of the offloaded step that did not do its job, in the order they run."""
    for step, s in enumerate(r["steps"]):
        where = f"rank {rank}, step {step}"
        if not s["grad_on_host"]:
            return (f"{where}: after grads_to_host the host buffer does not hold the device gradient shard exactly: "
                    "copy each gradient INTO its buffer in self.grads (a name rebound copies nothing), with no cast on "
                    "the way (copy_ casts to fp32 itself)")
        if s["optimizer_steps"] != 1:
            return (f"{where}: the CPU optimizer stepped {s['optimizer_steps']} times in one training step; "
                    "cpu_step must call self.optim.step() exactly once")
        if not s["masters_moved"]:
            return (f"{where}: the CPU optimizer stepped but the host masters did not move: the masters are what "
                    "it steps, and each needs its own gradient as .grad before self.optim.step()")
        if not s["device_is_master"]:
            return (f"{where}: the device parameters are not the updated masters: params_to_device must copy "
                    "each master into its device tensor (p.copy_(m.view(p.shape)))")
    return ""


def check_matches_ddp(impl):
    for rank, res in enumerate(_results(impl)):
        r = res["fp32"]
        if r["cpu_steps"] != STEPS:
            raise CheckFailed(f"rank {rank}: {r['cpu_steps']} CPU steps for {STEPS} training steps")
        broken = _broken_part(rank, r)
        if broken:  # a copy the wrong way, if the probe saw one, is the cause of what broke
            wrong = _wrong_way(res)
            raise CheckFailed(f"N={N}: your offloaded step differs from DDP. "
                              + (f"rank {rank}: {wrong}" if wrong else broken))
        name, excess = r["worst"]
        if excess > ATOL:
            raise CheckFailed(f"N={N}: rank {rank} parameter `{name}` differs from DDP after {STEPS} SGD steps (|diff| "
                              f"exceeds rtol 1e-6 by {excess:.2g}, allowed {ATOL:g}): the gradients must reach the "
                              "host, the CPU optimizer must step once, and the masters must come back to the device")
    r = _results(impl)[0]["fp32"]
    return f"N={N}: ZeRO-2 + your offloaded step equals DDP for {STEPS} SGD steps (max |diff| {r['max_diff']:.1e})"


def check_memory_by_location(impl):
    for rank, res in enumerate(_results(impl)):
        r = res["fp32"]
        shard = r["shard"] * 4
        for step, s in enumerate(r["steps"]):
            led, where = s["ledger"], f"rank {rank}, step {step}"
            for cat in ("master_params", "gradients", "optimizer_state"):
                if cat == "optimizer_state" and step == 0:
                    continue  # SGD's momentum exists after the first step
                if led[cat]["host"] < shard:
                    raise CheckFailed(f"{where}: {cat} on the host {led[cat]['host']} B, expected the shard's "
                                      f"{shard} B there (fp32)")
            if led["optimizer_state"]["device"] or led["master_params"]["device"]:
                raise CheckFailed(f"{where}: optimizer state {led['optimizer_state']['device']} B and master "
                                  f"{led['master_params']['device']} B on the DEVICE: both belong on the host")
            if s["grad_shared"]:
                raise CheckFailed(f"{where}: the host gradient buffer IS the device gradient shard (same storage): "
                                  "grads_to_host must copy into self.grads, not replace its tensors")
    led, ddp = _results(impl)[0]["fp32"]["steps"][-1]["ledger"], _results(impl)[0]["fp32"]["ddp_ledger"]
    dev = sum(v["device"] for v in led.values())
    return (f"rank 0 holds {dev} B on the device (DDP: {sum(v['device'] for v in ddp.values())} B) and "
            f"{sum(v['host'] for v in led.values())} B on the host")


def check_bytes(impl):
    for rank, res in enumerate(_results(impl)):
        for dtype, width in (("fp16", 2), ("fp32", 4)):
            r = res[dtype]
            want = width * r["shard"]
            for step, s in enumerate(r["steps"]):
                t = s["traffic"]
                if t["to_host"] != want:
                    raise CheckFailed(f"{dtype}, rank {rank}, step {step}: to_host counted {t['to_host']} B, expected "
                                      f"{want} B = {width} B x {r['shard']} shard elements (count the bytes that "
                                      "cross: the DEVICE dtype's element size)")
                if t["to_device"] != want:
                    raise CheckFailed(f"{dtype}, rank {rank}, step {step}: to_device counted {t['to_device']} B, "
                                      f"expected {want} B = {width} B x {r['shard']} (the device parameters' dtype)")
    for rank, res in enumerate(_results(impl)):
        for name, probe in res["tiers"].items():
            want = probe["numel"] * probe["element_size"]
            for step, s in enumerate(probe["steps"]):
                for way, got in (("to_host", s["to_host"]), ("to_device", s["to_device"])):
                    if got != want:
                        last = (f": only the last tensor's {s['last_bytes']} B are left, the count was set with `=` "
                                "instead of added with `+=`" if got == s["last_bytes"] else "")
                        raise CheckFailed(f"{name}, {len(SIZES)} device tensors of {list(SIZES)} elements, step "
                                          f"{step}: {way} counted {got} B, expected {want} B = {probe['element_size']} "
                                          f"B x {probe['numel']} elements{last}")
    r = _results(impl)[0]["fp16"]
    return (f"fp16: {r['steps'][-1]['traffic']['to_host']} B down + {r['steps'][-1]['traffic']['to_device']} B up "
            f"per step = 4 x {r['shard']} = 4 Psi/N (padded Psi = {r['padded']}, N = {N})")


def check_every_tensor(impl):
    """The three methods on several device tensors (ZeRO-3's shape: a shard per unit) in fp32, fp16
    and bf16, each method's effect observed on its own."""
    for rank, res in enumerate(_results(impl)):
        for name, probe in res["tiers"].items():
            for step, s in enumerate(probe["steps"]):
                where = f"{name}, {len(SIZES)} device tensors of {list(SIZES)} elements, step {step}"
                if not s["buffers_kept"]:
                    raise CheckFailed(f"{where}: grads_to_host replaced the host gradient buffers with new tensors: "
                                      "copy into the buffers of self.grads, allocated once (the ledger counts them, "
                                      "DPU alternates between two of them, and a new pinned buffer per step is an "
                                      "allocation on every step)")
                if s["device_grads_written"]:
                    raise CheckFailed(f"{where}: {WRONG_WAY['device_grads_written']}")
                if not s["host_exact"]:
                    raise CheckFailed(f"{where}: after grads_to_host the host buffers do not hold the device "
                                      "gradients: "
                                      + ("they went through fp16 on the way down (lossy): copy_ into the fp32 buffer "
                                         "casts once, with no rounding on the way" if s["host_via_fp16"]
                                         and name == "fp32"
                                         else "nothing reached them: copy INTO each buffer (host.copy_(...)); "
                                              "rebinding a name copies nothing" if s["host_untouched"] else
                                         "each buffer must receive its own device gradient, flattened"))
                if s["grad_on_buffers"]:
                    raise CheckFailed(f"{where}: {WRONG_WAY['grad_on_buffers']}")
                if s["stepped_self_grads"] and not s["masters_right"]:
                    raise CheckFailed(f"{where}: the masters stepped with self.grads, not with the `grads` cpu_step "
                                      "was given (under DPU self.grads is already the next backward's buffer, here "
                                      "zeroed)")
                if not all(s["moved"]):
                    still = [i for i, moved in enumerate(s["moved"]) if not moved]
                    raise CheckFailed(f"{where}: master(s) {still} of {len(SIZES)} did not move in cpu_step: give "
                                      "EVERY master its gradient before self.optim.step()")
                if not s["masters_right"]:
                    raise CheckFailed(f"{where}: the masters after cpu_step differ from torch SGD (momentum) on the "
                                      "given gradients: one optimizer step, on every master, with its own gradient")
                if s["masters_written"]:
                    raise CheckFailed(f"{where}: {WRONG_WAY['masters_written']}")
                if not s["device_kept"] or s["aliases_master"]:
                    raise CheckFailed(f"{where}: params_to_device rebound the device tensors (p.data = ...) instead of "
                                      "copying into them: the model's weights are views of the device memory and keep "
                                      "the old values" + (", and the device tensor now IS the host master" if
                                                          s["aliases_master"] else "") + "; copy_ into p")
                if not s["flat_right"]:
                    raise CheckFailed(f"{where}: after params_to_device the device memory does not hold the updated "
                                      "masters (cast to the device dtype): copy each master into its device tensor")
    return (f"{len(SIZES)} device tensors ({list(SIZES)} elements) in fp32, fp16 and bf16: gradients down exactly, "
            "into the same buffers; every master stepped with the gradients given; copied up in place")


def check_dpu(impl):
    """Stretch: step() with DPU overlaps the CPU step with the next backward, on its own buffer."""
    r = _results(impl)[0]["dpu"]
    if "stub" in r:
        raise CheckFailed(r["stub"])
    delayed = r["main_thread"][1:]
    if any(delayed):
        raise CheckFailed("DPU: the delayed CPU step ran on the main thread: nothing overlaps it; run cpu_step in a "
                          "thread (self._run) and let finish() join it")
    if not all(r["copied_up_on_main"]):
        raise CheckFailed("DPU: params_to_device ran on the CPU step's thread: the device parameters change while the "
                          "next forward and backward read them (a race, and the update lands mid-step); the thread "
                          "only computes, finish() copies the parameters up on the main thread")
    if not all(r["overlapped"]):
        raise CheckFailed("DPU: step() did not return until its delayed CPU step had finished (held here until the "
                          "next gradients arrived): it blocked on the thread, so nothing overlaps the step; start the "
                          "thread and return, finish() joins it at the next step")
    sets = r["gradient_buffers"] // r["per_buffer"]
    if sets > 2:
        raise CheckFailed(f"DPU: self.grads held {sets} different sets of host gradient buffers in "
                          f"{len(r['main_thread'])} steps: make the spare set once (self._spare) and swap the two; a "
                          "new set each step is an allocation of 4 bytes x Psi/N on every step")
    if -1 in r["device_after_step"] or not r["masters_right"] or not r["final_right"]:
        raise CheckFailed("DPU: the parameters differ from torch SGD on the same gradients: the delayed step used the "
                          "buffer the next backward was filling; hand the thread the filled buffer and give "
                          "self.grads the spare one before it starts")
    want = [1] + list(range(1, len(r["device_after_step"])))
    if r["device_after_step"] != want:
        raise CheckFailed(f"DPU: right after step() the device held the parameters of step {r['device_after_step']}, "
                          f"expected {want}: under DPU the device computes step t+1 with step t-1's parameters, the "
                          "update is copied up by finish() at the next step, not when the thread starts or ends")
    return "DPU: the delayed step runs in a thread on its own buffer, the device gets its result at the next step"

CHECKS = [
    Check("ZeRO-2 + offloaded step trains like DDP (N=2, SGD momentum)", 3, check_matches_ddp),
    Check("several device tensors in fp32, fp16, bf16: each method does its part", 3, check_every_tensor),
    Check("master, gradients and optimizer state live on the host", 2, check_memory_by_location),
    Check("bytes counted = 2 + 2 per element in 16 bits (4 + 4 in fp32), every tensor", 2, check_bytes),
    Check("stretch: DPU, the delayed step in a thread on its own buffer (extra points)", 2, check_dpu, extra=True),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab07_offload.py` shows."""
    from minizero_course.experiments.offload import side_by_side
    r = side_by_side(comm, impl.HostOptimizer, 5)
    h = side_by_side(comm, impl.HostOptimizer, 2, dtype=torch.float16)
    rows = comm.allgather_object(r["steps"][-1]["ledger"])
    if comm.rank == 0:
        print(f"TinyGPT {r['psi']} parameters, {comm.size} ranks: ZeRO-2 with your offloaded step vs DDP (SGD)")
        for step, s in enumerate(r["steps"]):
            print(f"  step {step}: loss {s['loss']:.6f}")
        print(f"  max |param - DDP| after {len(r['steps'])} steps: {r['max_diff']:.2e}")
        print("memory per rank (ledger, bytes): device / host")
        for rank, led in enumerate(rows):
            print(f"  rank {rank}: "
                  + ", ".join(f"{c} {v['device']}/{v['host']}" for c, v in led.items() if any(v.values())))
        t = h["steps"][-1]["traffic"]
        print(f"fp16 bytes per step and rank: {t['to_host']} down + {t['to_device']} up = 4 x {h['shard']} (4 Psi/N)")
