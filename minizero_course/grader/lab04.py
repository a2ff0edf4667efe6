"""Lab 04 checks: the ZeRO-1 step (your `step_shard`) trains like DDP, keeps 1/N of the
optimizer state, and sends 2(N-1)/N·Ψ·4 bytes per step.

The harness is the lessons' own (minizero_course/experiments/zero12.py: side_by_side trains DDP and a
ZeRO stage in lockstep): the code that grades a lab is the code that measures the lesson.
"""
import math

from minizero_course.grader import Check, CheckFailed, Lab, launched_once, print_losses
from minizero_course.grader.hints import update_size_cause
from minizero_course.experiments.references import buffer_bytes
from minizero_course.experiments.zero12 import GPT, side_by_side
from minizero.models import build_model

LAB = Lab(4, "zero1", "ZeRO-1: the sharded optimizer step", "minizero/zero/sharded_optimizer.py")

# atol at rtol 1e-6 against DDP (tests/test_zero12.py explains): SGD 2e-7 on both models,
# Adam only on the edge model, where it is as tight (TinyGPT has gradients that are zero in
# exact arithmetic, and Adam turns their rounding into lr-sized steps).
TOL = {"sgd": 2e-7, "adam": 1e-7}


# ---------------------------------------------------------------------------- the checks
def _impl_class(impl, name):
    from minizero.launch import load_target
    return load_target(impl + ":" + name)


# The runs "trains like DDP" compares, each against DDP in lockstep: fp32 first, then the bf16
# path (bf16 parameters and gradients, fp32 master shard: in fp32 the master IS the shard, so
# only here does a stale shard show), then two micro-batches accumulated before each step.
RUNS = {"tiny-gpt/sgd": dict(model="tiny-gpt", opt="sgd"), "edge/adam": dict(model="edge", opt="adam"),
        "edge/sgd": dict(model="edge", opt="sgd"),
        "tiny-gpt/sgd/bf16": dict(model="tiny-gpt", opt="sgd", dtype="bfloat16"),
        "edge/sgd/2 micro-batches": dict(model="edge", opt="sgd", micro=2)}
CAUSES = {"bf16": "only the bf16 run differs: there the optimizer steps an fp32 master shard, and the model "
                  "must get the UPDATED master (cast to bf16) in the all-gather, not the old bf16 shard",
          "micro-batches": "only the run that accumulates 2 micro-batches per step differs: each backward must "
                           "ADD its reduced gradient into the shard (micro-batches accumulate), not replace it"}


def correctness_worker(comm, impl, stage=1, name="ShardedOptimizer"):
    cls = _impl_class(impl, name)
    return {key: side_by_side(comm, stage, cls, steps=4, **kw)["diffs"] for key, kw in RUNS.items()}


def measure_worker(comm, impl, stage=1, name="ShardedOptimizer"):
    cls = _impl_class(impl, name)
    return {model: side_by_side(comm, stage, cls, model, opt="adam", steps=2) for model in ("tiny-gpt", "edge")}


def check_matches_ddp(impl, stage=1, name="ShardedOptimizer", n=3):
    from minizero import launch
    res = launch.run(f"minizero_course.grader.lab{stage + 3:02d}:correctness_worker", nprocs=n,
                     args={"impl": impl, "stage": stage, "name": name}, timeout=120)
    lines = []
    for key in res[0]:  # in RUNS order: fp32 first, so a later failure names its own cause
        tol = TOL[key.split("/")[1]]
        for rank, out in enumerate(res):
            for w in out[key]:  # step by step: report the first step that goes wrong
                if not w["atol_needed"] <= tol or math.isnan(w["max_diff"]):
                    cause = next((c for k, c in CAUSES.items() if k in key), "")
                    cause = cause or update_size_cause(w.get("update_ratio", float("nan")), n).strip()
                    raise CheckFailed(f"{key} at N={n}: rank {rank} parameter `{w['param']}` differs from DDP at "
                                      f"step {w['step']} (max diff {w['max_diff']:.3g}; allowed: rtol 1e-6 + atol "
                                      f"{tol:g})"
                                      + (f". {cause[0].upper()}{cause[1:]}" if cause else ""))
        lines.append(f"{key}: max diff from DDP {max(w['max_diff'] for o in res for w in o[key]):.2g} over 4 steps, "
                     f"N={n}")
    return "\n".join(lines)


def measured(impl, stage=1, name="ShardedOptimizer", n=4):
    """One 4-rank run shared by the memory and bytes checks (cached per file)."""
    return launched_once(f"minizero_course.grader.lab{stage + 3:02d}:measure_worker", n,
                         {"impl": impl, "stage": stage, "name": name}, timeout=120)


def check_optimizer_state_sharded(impl):
    lines = []
    for model in ("tiny-gpt", "edge"):
        for rank, out in enumerate(measured(impl)):
            L, led = out[model]["layout"], out[model]["ledger"]
            # Adam: exp_avg + exp_avg_sq for the shard, and one fp32 step counter
            want = 2 * L["shard_numel"] * 4 + 4
            if led["optimizer_state"] > want:
                raise CheckFailed(f"{model}: optimizer state {led['optimizer_state']} B on rank {rank}, expected "
                                  f"<= {want} B (Adam's two fp32 moments for a shard of {L['shard_numel']} elements)")
            if led["master_params"]:
                raise CheckFailed(f"{model}: rank {rank} holds {led['master_params']} B of master copy with fp32 "
                                  "parameters: step the flat buffer's shard itself")
            if led["gradients"] > 4 * L["padded_numel"]:
                raise CheckFailed(f"{model}: rank {rank} holds {led['gradients']} B of gradients after the step, "
                                  f"expected the flat gradient only ({4 * L['padded_numel']} B): the master shard "
                                  "kept its gradient. Set self.master.grad = None once the inner step is done")
        r0 = measured(impl)[0][model]
        lines.append(f"{model}: optimizer state on rank 0 {r0['ledger']['optimizer_state']} B "
                     f"(DDP: {r0['ddp_ledger']['optimizer_state']} B), N=4")
    return "\n".join(lines)


def check_bytes(impl, stage=1, name="ShardedOptimizer", n=4):
    lines = []
    for model in ("tiny-gpt", "edge"):
        # ZeRO-2 wraps the forward, so rank 0's buffers are broadcast first (torch DDP's default)
        buffers = (n - 1) / n * buffer_bytes(build_model(model, seed=0, **(GPT if model == "tiny-gpt" else {})))
        for rank, out in enumerate(measured(impl, stage, name, n)):
            P = out[model]["layout"]["padded_numel"]
            want = 2 * (n - 1) / n * P * 4 + (buffers if stage == 2 else 0)
            for s, sent in enumerate(out[model]["sent"]):
                if abs(sent - want) > 1e-6 * want:
                    raise CheckFailed(f"{model}: rank {rank} sent {sent:.0f} B in step {s}, expected 2(N-1)/N * "
                                      f"padded Psi * 4 = {2 * (n - 1) / n * P * 4:.0f} B"
                                      + (f" + {buffers:.0f} B of buffers" if stage == 2 and buffers else "")
                                      + f" ({out[model]['sent_by_op']})")
        lines.append(f"{model}: {want:.0f} B per rank per step = 2(N-1)/N * {P} * 4, N={n}")
    return "\n".join(lines)


CHECKS = [
    Check("trains like DDP (N=3; SGD and Adam; tied, frozen, unused, padded; bf16; accumulation)", 5,
          check_matches_ddp),
    Check("optimizer state is 1/N per rank, no gradient kept by the step (ledger, N=4)", 3,
          check_optimizer_state_sharded),
    Check("bytes per step = 2(N-1)/N * padded Psi * 4 (N=4)", 2, check_bytes),
]


def print_report(comm, res, label):
    """The lab demo's printout (rank 0), from side_by_side's results of every rank."""
    everyone = comm.allgather_object({k: res[k] for k in ("ledger", "ddp_ledger", "sent", "ddp_sent")})
    if comm.rank:
        return
    print(f"\n{label} vs DDP on {comm.size} ranks, TinyGPT, Adam, {len(res['losses'])} steps")
    print_losses("loss DDP", res["ddp_losses"], f"loss {label}", res["losses"])
    w = res["worst"]
    print(f"largest parameter difference from DDP: {w['max_diff']:.2g} (`{w['param']}`, step {w['step']}, rank 0)")
    if w["max_diff"] > 0:
        print("  (not 0: the reduction adds in another order than DDP's all-reduce, and Adam turns the\n"
              "   rounding of gradients that are ~0 in exact arithmetic, like the attention key bias, into\n"
              "   steps of up to lr. The grader compares with SGD, and Adam on a model without them.)")
    print(f"\nbytes per rank after the last step ({label} | DDP):")
    cats = ("parameters", "master_params", "gradients", "optimizer_state")
    print(f"{'rank':>4} " + " ".join(f"{c:>24}" for c in cats))
    for r, e in enumerate(everyone):
        print(f"{r:>4} " + " ".join(f"{e['ledger'][c]:>11} | {e['ddp_ledger'][c]:>10}" for c in cats))
    L = res["layout"]
    n = comm.size
    print(f"\nbytes sent per rank per step: {label} {everyone[0]['sent'][-1]:.0f}, DDP "
          f"{everyone[0]['ddp_sent'][-1]:.0f}; 2(N-1)/N * padded Psi * 4 = "
          f"{2 * (n - 1) / n * L['padded_numel'] * 4:.0f}")


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab04_zero1.py` shows."""
    res = side_by_side(comm, 1, impl.ShardedOptimizer, "tiny-gpt", opt="adam", steps=8)
    print_report(comm, res, "ZeRO-1")
