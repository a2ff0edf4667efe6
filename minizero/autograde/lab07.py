"""Lab 07 checks: your offloaded step (HostOptimizer.grads_to_host, cpu_step, params_to_device in
minizero/zero/offload.py) trains ZeRO-2 like DDP, keeps the master copy, the gradients and the
optimizer state on the host, and moves exactly 2 + 2 bytes per shard element in fp16.

One 2-rank job per submission runs the harness of lesson 07 (minizero.experiments.offload.
side_by_side) in fp32 and fp16; the three checks read its report."""
import torch

from minizero.autograde import Check, CheckFailed, Lab

LAB = Lab(7, "offload", "ZeRO-Offload: gradients down, CPU step, parameters up", "minizero/zero/offload.py")
N, STEPS = 2, 4
ATOL = 2e-7  # at rtol 1e-6: fp32 SGD, the same float operations as DDP up to the order of additions


def worker(comm, impl):
    from minizero.experiments.offload import side_by_side
    from minizero.launch import load_target
    torch.set_num_threads(1)
    HostOptimizer = load_target(impl + ":HostOptimizer")
    return {"fp32": side_by_side(comm, HostOptimizer, STEPS),
            "fp16": side_by_side(comm, HostOptimizer, 2, dtype=torch.float16)}


_cache = {}


def _results(impl):
    from minizero import launch
    if impl not in _cache:
        try:
            _cache[impl] = launch.run("minizero.autograde.lab07:worker", nprocs=N, args={"impl": impl}, timeout=180)
        except Exception as e:  # noqa: BLE001  (the grader reports it; see autograde.run_check)
            _cache[impl] = e
    if isinstance(_cache[impl], Exception):
        raise _cache[impl]
    return _cache[impl]


def _broken_part(rank, r):
    """The first part of the offloaded step that did not do its job, in the order they run."""
    for step, s in enumerate(r["steps"]):
        where = f"rank {rank}, step {step}"
        if not s["grad_on_host"]:
            return (f"{where}: after grads_to_host the host buffer does not hold the device gradient shard: "
                    "copy each gradient INTO its buffer in self.grads (host.copy_(...)); rebinding a name copies nothing")
        if s["optimizer_steps"] != 1:
            return (f"{where}: the CPU optimizer stepped {s['optimizer_steps']} times in one training step; "
                    "cpu_step must call self.optim.step() exactly once")
        if not s["masters_moved"]:
            return (f"{where}: the CPU optimizer stepped but the host masters did not move: give each master its "
                    "gradient (m.grad = g) before self.optim.step()")
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
        if broken:
            raise CheckFailed(f"N={N}: your offloaded step differs from DDP. {broken}")
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
    r = _results(impl)[0]["fp16"]
    return (f"fp16: {r['steps'][-1]['traffic']['to_host']} B down + {r['steps'][-1]['traffic']['to_device']} B up "
            f"per step = 4 x {r['shard']} = 4 Psi/N (padded Psi = {r['padded']}, N = {N})")


CHECKS = [
    Check("ZeRO-2 + offloaded step trains like DDP (N=2, SGD momentum)", 5, check_matches_ddp),
    Check("master, gradients and optimizer state live on the host", 3, check_memory_by_location),
    Check("bytes counted = 2 + 2 per shard element in fp16 (4 + 4 in fp32)", 2, check_bytes),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab07_offload.py` shows."""
    from minizero.experiments.offload import side_by_side
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
            print(f"  rank {rank}: " + ", ".join(f"{c} {v['device']}/{v['host']}" for c, v in led.items() if any(v.values())))
        t = h["steps"][-1]["traffic"]
        print(f"fp16 bytes per step and rank: {t['to_host']} down + {t['to_device']} up = 4 x {h['shard']} (4 Psi/N)")
