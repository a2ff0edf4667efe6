"""Lab 10 checks: your f and g operators and column/row-parallel linear layers (minizero/tensor/
layers.py) against nn.Linear, the single-process TinyGPT and DDP, with the collectives counted.

ONE 4-rank job measures everything (`measure_worker`); each check judges its part of the result
(`judge_*`), so the grader launches once per submission and the mutation suite (tests/mutants/
lab10.py) grades all its mutants in one job too. Phases run one after the other on every rank:
  f/g        f and g alone on rank-dependent data: values and collectives in each pass
  slices     from_linear of a column layer (plain and fused q|k|v, chunks=3) and a row layer:
             which rows/columns of nn.Linear's weight each rank holds
  mlp        Column -> GeLU -> Row against nn.Linear -> GeLU -> nn.Linear: output, input and
             weight gradients, collectives per layer per pass
  gpt        TinyGPT at t=4, and t=2 with sequence parallelism x DDP over dp=2, 3 SGD steps
             (minizero_course.experiments.tensor.side_by_side with your classes)
A phase that raises in your code is recorded (with the error) and the next phase runs; the ranks
agree on errors before any collective, so a crash is a failed check, never a hang.
"""
from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager

import torch
import torch.nn as nn

from minizero_course.grader import Check, CheckFailed, Lab, first_phase, judged_check, launched_once, print_losses

LAB = Lab(10, "tensor_parallel", "Tensor parallelism: f/g, column- and row-parallel linear",
          "minizero/tensor/layers.py")

ATOL = 2e-7  # at rtol 1e-6: only the order of float32 additions differs from one process
ATOL_T2 = 5e-7  # the MLP at tp 2: c_fc.bias's gradient sums 8 features' GeLU terms in another order (2.1e-7 measured)
GPT_STEPS = 3


def load(impl: str):
    """The student's module (once per file and process)."""
    name = "_lab10_" + str(abs(hash(impl)))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, impl)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _phase(comm, fn):
    """Run fn(); an exception in student code becomes {"error": ...} on every rank alike."""
    try:
        out, err = fn(), None
    except NotImplementedError:
        raise  # a stub: the grader reports the TODO's own message
    except Exception as e:  # noqa: BLE001 - whatever the student's code raised is the result
        out, err = None, f"{type(e).__name__}: {e}"
    errors = [e for e in comm.allgather_object(err) if e]
    return {"error": errors[0]} if errors else out


def measure_phases(comm, impls: list[str], table: dict, phases, run=_phase) -> dict:
    """{impl: {phase: result}}: each file loaded, then each phase of `table` asked for, run by
    `run` (_phase: a stub ends the job; _phase_or_todo: it fails only its phase)."""
    torch.set_num_threads(1)
    out = {}
    for impl in impls:
        mod = _phase(comm, lambda: load(impl))
        if isinstance(mod, dict):
            out[impl] = {p: mod for p in phases}
            continue
        out[impl] = {name: run(comm, lambda fn=table[name]: fn(comm, mod)) for name in phases}
    return out


def _phase_or_todo(comm, fn):
    """_phase, but a TODO left becomes this phase's error: the checks of the other phases still grade
    (a lab's tasks earn their points one by one)."""
    def run():
        try:
            return fn()
        except NotImplementedError as e:
            raise RuntimeError(f"NotImplementedError: {e}") from None
    return _phase(comm, run)


# ------------------------------------------------------------------------------ the phases
def _fg_pass(comm, mod, dtype, base, watch):
    """f and g over `comm` on data that depends on the rank in `base` (the job's ranks): values
    against the sums over comm's ranks, the collectives on comm (calls and payload bytes) and on
    the `watch` communicators (the other groups, where none may run)."""
    from minizero_course.experiments.tensor import atol_needed, collective_calls
    members = comm.allgather_object(base.rank)  # whose data this group sums (before any reset)
    out = {}
    for name, fn in (("f", mod.copy_to_tensor_parallel), ("g", mod.reduce_from_tensor_parallel)):
        me = base.rank
        x = _data(10 + me, 3, 5).to(dtype).requires_grad_()
        dy = _data(20 + me, 3, 5).to(dtype)
        xs = torch.stack([_data(10 + r, 3, 5) for r in members]).to(dtype).float()   # every member's x
        dys = torch.stack([_data(20 + r, 3, 5) for r in members]).to(dtype).float()  # and dy
        everyone = torch.stack([_data(10 + r, 3, 5) for r in range(base.size)]).to(dtype).float()
        passes = {}

        def measured(phase, run, passes=passes):
            for c in (comm, *watch):
                c.stats.reset()
            result = run()
            passes[phase] = collective_calls(comm)
            passes[phase + "_bytes"] = {op: st["payload_bytes"] for op, st in comm.stats.as_dict().items()
                                        if st["calls"]}
            own = sum(collective_calls(comm).values())  # a group's calls also count in its parents' stats
            passes[phase + "_elsewhere"] = max([sum(collective_calls(c).values()) - own for c in watch], default=0)
            return result
        y = measured("forward", lambda fn=fn, x=x: fn(x, comm))
        measured("backward", lambda y=y, dy=dy: y.backward(dy))
        want_y, want_dx = (x.detach().float(), dys.sum(0)) if name == "f" else (xs.sum(0), dy.float())
        tol = 0 if dtype == torch.float32 else 0.05  # bf16: the values are only sanity-checked
        out[name] = {**passes, "numel": x.numel(), "element_size": x.element_size(),
                     "y_dtype": str(y.dtype), "dx_dtype": str(x.grad.dtype),
                     "y": atol_needed(y.detach().float(), want_y) - tol,
                     "y_is_mean": atol_needed(y.detach().float(), want_y / comm.size),
                     "y_is_world_sum": atol_needed(y.detach().float(), everyone.sum(0)) if name == "g" else 1.0,
                     "dx": atol_needed(x.grad.float(), want_dx) - tol,
                     "dx_is_mean": atol_needed(x.grad.float(), want_dx / comm.size)}
    return out


def fg_phase(comm, mod):
    """f and g at t = comm.size (fp32 and bf16), and over the tp group of tp 2 on the same ranks
    with every other group watched (the call's and the job's world)."""
    from minizero.comm import Mesh
    tp, above = Mesh(comm, tp=2).tp, _others(comm)
    return {"t4": _fg_pass(comm, mod, torch.float32, comm, above),
            "bf16": _fg_pass(comm, mod, torch.bfloat16, comm, above),
            "t2": _fg_pass(tp, mod, torch.float32, comm, (comm, *above))}


def _held(local: torch.Tensor, full: torch.Tensor) -> list[int]:
    """Which rows of `full` the rows of `local` are (-1: none)."""
    return [next((i for i, f in enumerate(full) if torch.equal(row, f)), -1) for row in local]


def slices_phase(comm, mod):
    torch.manual_seed(0)
    column, fused, row = nn.Linear(8, 12), nn.Linear(8, 24), nn.Linear(12, 8)
    out = {}
    for name, build, full, by_columns in (
            ("column", lambda: mod.ColumnParallelLinear.from_linear(column, comm), column, False),
            ("fused", lambda: mod.ColumnParallelLinear.from_linear(fused, comm, chunks=3), fused, False),
            ("row", lambda: mod.RowParallelLinear.from_linear(row, comm), row, True)):
        layer = _phase(comm, build)
        if isinstance(layer, dict):
            out[name] = layer
            continue
        weight, w_full = (layer.weight.detach().t(), full.weight.detach().t()) if by_columns else \
            (layer.weight.detach(), full.weight.detach())
        bias = layer.bias.detach()
        out[name] = {"shape": list(layer.weight.shape), "held": _held(weight, w_full),
                     "bias": bias.tolist(), "full_bias": full.bias.detach().tolist(),
                     "bias_held": _held(bias.unsqueeze(1), full.bias.detach().unsqueeze(1))}
    return out


def _others(comm):
    """The groups above `comm` that a collective must not reach: the job's world if comm is not it."""
    from minizero import comm as comm_mod
    world = comm_mod.get() if comm_mod.is_initialized() else comm
    return () if world is comm else (world,)


def mlp_phase(comm, mod):
    """The MLP at t = comm.size, and at tp 2 on the same ranks (two groups of 2); every collective
    must run on the layers' own tp group: the groups above it are watched."""
    from minizero.comm import Mesh
    out = {"t4": _mlp_on(comm, mod, _others(comm))}
    out["t2"] = _mlp_on(Mesh(comm, tp=2).tp, mod, (comm, *_others(comm)))
    return out


def _mlp_on(group, mod, watch):
    from minizero_course.experiments.tensor import collective_calls, mlp_side_by_side
    for c in watch:
        c.stats.reset()
    run = mlp_side_by_side(group, mod.ColumnParallelLinear, mod.RowParallelLinear)
    on_group = {"all_gather": 3}  # mlp_side_by_side gathers three weight gradients over the group to compare them
    for calls in run["calls"].values():
        for op, n in calls.items():
            on_group[op] = on_group.get(op, 0) + n
    run["elsewhere"] = {}  # a group's calls count in its parents' stats too: what is left ran on another group
    for c in watch:
        for op, n in collective_calls(c).items():
            if n > on_group.get(op, 0):
                run["elsewhere"][op] = max(run["elsewhere"].get(op, 0), n - on_group.get(op, 0))
    return run


def gpt_phase(comm, mod):
    from minizero.comm import Mesh
    from minizero_course.experiments.tensor import side_by_side
    classes = {"column_cls": mod.ColumnParallelLinear, "row_cls": mod.RowParallelLinear}
    return {"t4": side_by_side(Mesh(comm, tp=4), steps=GPT_STEPS, **classes)}


COLLECTIVE_METHODS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
                      "all_to_all")


@contextmanager
def _called_on(groups, calls: dict):
    """Counts in `calls` the collectives called on `groups` themselves (a sub-group's calls are
    its own: its methods are not these), by wrapping their methods for the block."""
    def counted(group, name):
        method = getattr(group, name)

        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return method(*args, **kwargs)
        return call
    for group in groups:
        for name in COLLECTIVE_METHODS:
            setattr(group, name, counted(group, name))
    try:
        yield calls
    finally:
        for group in groups:
            for name in COLLECTIVE_METHODS:
                delattr(group, name)


def sp_phase(comm, mod):
    """The stretch task: TinyGPT at tp 2 with sequence parallelism (tied embeddings) x DDP over dp 2.
    Its stub is recorded, not raised: an untouched stretch task costs the main checks nothing. Every
    collective must run on the tp (or dp) group of 2: one on the 4 ranks, or the job's world, is
    recorded with what it led to (a reduce-scatter over 4 ranks cuts the sequence in 4, and the
    shapes then fail somewhere else: the group is the cause)."""
    from minizero.comm import Mesh
    from minizero_course.experiments.tensor import side_by_side
    classes = {"column_cls": mod.ColumnParallelLinear, "row_cls": mod.RowParallelLinear}
    mesh, elsewhere = Mesh(comm, tp=2), {}
    try:
        with _called_on((comm, *_others(comm)), elsewhere):
            run = side_by_side(mesh, sequence_parallel=True, tied=True, steps=GPT_STEPS, **classes)
    except NotImplementedError as e:  # the same stub on every rank, at the same point: no collective is left waiting
        return {"stub": str(e)}
    except Exception as e:  # noqa: BLE001 - what a collective on the wrong group led to
        if not elsewhere:
            raise
        return {"elsewhere": elsewhere, "then": f"{type(e).__name__}: {e}"}
    return {"elsewhere": elsewhere} if elsewhere else {"t2-sp-ddp": run}


def _has_error(result) -> bool:
    return isinstance(result, dict) and ("error" in result or any(_has_error(v) for v in result.values()))


PHASES = {"fg": fg_phase, "slices": slices_phase, "mlp": mlp_phase, "gpt": gpt_phase, "sp": sp_phase}


def measure_worker(comm, impls: list[str], phases=tuple(PHASES)) -> dict:
    """{impl: {phase: result}} for each file; `phases`: which to run (the mutation test skips "gpt")."""
    torch.set_num_threads(1)
    out = {}
    for impl in impls:
        mod = _phase(comm, lambda: load(impl))
        if isinstance(mod, dict):
            out[impl] = {p: mod for p in PHASES}
            continue
        res = out[impl] = {}
        for name, fn in PHASES.items():
            if name not in phases:
                continue
            broken = [p for p in ("slices",) if p in res and _has_error(res[p])]
            if name in ("mlp", "gpt", "sp") and broken:  # an error in from_linear may be on some ranks only
                res[name] = {"error": "skipped: building the layers failed (see the slices check)"}
                continue
            res[name] = _phase(comm, lambda fn=fn: fn(comm, mod))
    return out


def measured(impl: str) -> list:
    """One 4-rank run per file, shared by the checks (a stub's error is shared too)."""
    return [r[impl] for r in
            launched_once("minizero_course.grader.lab10:measure_worker", 4, {"impls": [impl]}, 180)]


# ------------------------------------------------------------------------------ the judges
def _ops(calls: dict) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(calls.items())) or "no collective"


def judge_fg(results) -> str:
    t = len(results)
    for rank, r in enumerate(first_phase(results, "fg")):
        _judge_fg_group(rank, r["t4"], f"t={t}")
        _judge_fg_group(rank, r["t2"], f"tp 2 on {t} ranks")
        _judge_fg_values(rank, r["t4"], t, "")
        _judge_fg_values(rank, r["t2"], 2, " (tp 2 on 4 ranks)")
        _judge_fg_dtype(rank, r["bf16"])
    return (f"f: identity forward, 1 all-reduce (sum) backward; g: 1 all-reduce (sum) forward, identity backward "
            f"(t={t}, and tp 2 on {t} ranks on its own group); bf16 stays bf16 on the wire")


def _judge_fg_values(rank, r, t, where):
    f, g = r["f"], r["g"]
    if f["forward"]:
        swapped = " (f and g swapped?)" if not g["forward"] else ""
        raise CheckFailed(f"f ran {_ops(f['forward'])} in forward{where}, expected none: f is the identity in forward "
                          f"(every rank already holds the whole input); its all-reduce belongs to backward{swapped}")
    if f["y"] > 0:
        raise CheckFailed(f"rank {rank}: f's forward changed its input{where} (max diff {f['y']:.3g}): it is the "
                          "identity")
    if f["backward"] != {"all_reduce": 1}:
        raise CheckFailed(f"f ran {_ops(f['backward'])} in backward{where}, expected 1 all_reduce: f's backward must "
                          "sum the partial input gradients of the t ranks (missing all-reduce in backward?)")
    if f["dx"] > ATOL:
        why = ("the average: all-reduce with op='sum', not 'avg'" if f["dx_is_mean"] <= ATOL
               else "not the sum of every rank's gradient")
        raise CheckFailed(f"rank {rank}: f's backward{where} returned {why} (max diff {f['dx']:.3g}, t={t})")
    if g["forward"] != {"all_reduce": 1}:
        raise CheckFailed(f"g ran {_ops(g['forward'])} in forward{where}, expected 1 all_reduce (the sum of the "
                          "partial results)")
    if g["y"] > ATOL:
        why = ("the average of the ranks' inputs: all-reduce with op='sum' (averaging instead of summing)"
               if g["y_is_mean"] <= ATOL else "not the sum of every rank's input")
        raise CheckFailed(f"rank {rank}: g's forward{where} returned {why} (max diff {g['y']:.3g}, t={t})")
    if g["backward"]:
        raise CheckFailed(f"g ran {_ops(g['backward'])} in backward{where}, expected none: g is the identity in "
                          "backward (the gradient of a sum is the same on every rank)")
    if g["dx"] > 0:
        raise CheckFailed(f"rank {rank}: g's backward{where} changed the gradient (max diff {g['dx']:.3g}): pass it "
                          "through")


def _judge_fg_group(rank, r, where):
    """A collective on another group (the world) than the comm passed in."""
    for name, passes in r.items():
        for phase in ("forward", "backward"):
            if passes[phase + "_elsewhere"]:
                summed = (" (it summed all 4 ranks' inputs)" if name == "g" and where.startswith("tp")
                          and passes["y_is_world_sum"] <= ATOL else "")
                raise CheckFailed(f"rank {rank}, {where}: {name}'s {phase} ran {passes[phase + '_elsewhere']} "
                                  f"collective(s) on another group than the tp group it was given (the world group?)"
                                  f"{summed}: f and g communicate over the tensor-parallel group passed in, the ranks "
                                  "that hold the slices, never over the world")


def _judge_fg_dtype(rank, r):
    """bf16 in: bf16 out, and 2 bytes per element on the wire (an fp32 reduction doubles them)."""
    for name, phase, wanted in (("g", "forward", "y_dtype"), ("f", "backward", "dx_dtype")):
        p = r[name]
        sent = p[phase + "_bytes"].get("all_reduce", 0)
        want = p["numel"] * p["element_size"]
        if sent != want:
            raise CheckFailed(f"rank {rank}: {name}'s {phase} all-reduce carried {sent} B for {p['numel']} bfloat16 "
                              f"elements, expected {want} B (2 B each): reducing in float32 doubles the bytes on the "
                              "wire; all-reduce in the input's dtype")
        if p[wanted] != "torch.bfloat16":
            raise CheckFailed(f"rank {rank}: {name}'s {phase} returned {p[wanted]} for a bfloat16 input: return the "
                              "input's dtype (a float32 result doubles every later all-reduce's bytes)")


def judge_slices(results) -> str:
    t = len(results)
    for rank, r in enumerate(first_phase(results, "slices")):
        for name, rows, what in (("column", 12, "rows (output features, dim 0)"),
                                 ("fused", 24, "rows (output features, dim 0)"),
                                 ("row", 12, "columns (input features, dim 1)")):
            layer = ("RowParallelLinear" if name == "row" else "ColumnParallelLinear"
                     + ("(chunks=3)" if name == "fused" else ""))
            res = r[name]
            if "error" in res:
                raise CheckFailed(f"{layer}.from_linear raised {res['error']}. It keeps its {what} of the weight")
            k = rows // t
            if name == "fused":  # rank r: its k/3 rows of each of the q, k, v blocks
                block = rows // 3
                want = [c * block + rank * (block // t) + i for c in range(3) for i in range(block // t)]
            else:
                want = list(range(rank * k, (rank + 1) * k))
            if res["held"] != want:
                hint = (": the fused layer is [q | k | v]: take the rank's slice of EACH block (shard with chunks)"
                        if name == "fused" and res["held"] == list(range(rank * k, (rank + 1) * k))
                        else " (wrong split dim?)" if -1 in res["held"] else " (wrong slice offsets?)")
                raise CheckFailed(f"rank {rank}: {layer} holds {what} {res['held']} of nn.Linear's weight, expected "
                                  f"{want}{hint}")
            full_bias, bias = res["full_bias"], res["bias"]
            if name == "row" and bias != full_bias:
                raise CheckFailed(f"rank {rank}: RowParallelLinear's bias is not nn.Linear's whole bias: the "
                                  "row-parallel bias is not split (it is added once, to the summed output)")
            if name != "row" and res["bias_held"] != want:
                raise CheckFailed(f"rank {rank}: {layer} holds bias elements {res['bias_held']}, expected {want}: "
                                  "slice the bias like the weight's rows")
    return f"column (plain and fused q|k|v) and row layers hold the right slices of nn.Linear on each of {t} ranks"


def judge_mlp(results) -> str:
    t = len(results)
    for rank, r in enumerate(first_phase(results, "mlp")):
        for run, where, atol in ((r["t4"], "", ATOL), (r["t2"], " (tp 2 on 4 ranks)", ATOL_T2)):
            if run.get("elsewhere"):
                raise CheckFailed(f"rank {rank}{where}: the layers ran {_ops(run['elsewhere'])} on another group than "
                                  "their tp group (the world group?): pass self.comm, the tensor-parallel group, to "
                                  "f and g")
            _judge_mlp_run(rank, run, where, atol)
    return (f"Column -> GeLU -> Row equals nn.Linear -> GeLU -> nn.Linear to rtol 1e-6 + {ATOL:g} (output, input and "
            f"weight gradients); 1 all-reduce forward (row), 1 backward (column), t={t} and tp 2 on {t} ranks")


def _judge_mlp_run(rank, r, where, atol):
    c = r["calls"]
    column, row = c["ColumnParallelLinear forward"], c["RowParallelLinear forward"]
    swapped = " (f and g swapped?)" if column and not row.get("all_reduce") else ""
    for name, want, why in (
            ("ColumnParallelLinear forward", {}, "f is the identity in forward"),
            ("RowParallelLinear forward", {"all_reduce": 1}, "g sums the partial products once"),
            ("RowParallelLinear backward", {}, "g is the identity in backward"),
            ("ColumnParallelLinear backward", {"all_reduce": 1}, "f's backward sums dL/dx over the ranks")):
        if c[name] != want:
            raise CheckFailed(f"{name}{where}: {_ops(c[name])}, expected {_ops(want)}: {why}{swapped}")
    if r["z"] > atol:
        if r["z_extra_bias"] <= atol:
            raise CheckFailed(f"rank {rank}{where}: the MLP output is nn.Linear's + (t-1) x bias: the row-parallel "
                              "bias was added on every rank before the sum; add it once, after g")
        raise CheckFailed(f"rank {rank}{where}: the MLP output differs from nn.Linear's (max excess {r['z']:.3g} over "
                          "rtol 1e-6)")
    if r["dx"] > atol:
        raise CheckFailed(f"rank {rank}{where}: the input gradient differs from nn.Linear's (excess {r['dx']:.3g})")
    for name, excess in r["grads"].items():
        if excess > atol:
            raise CheckFailed(f"rank {rank}{where}: the gradient of {name} (gathered) differs from nn.Linear's "
                              f"(excess {excess:.3g} over rtol 1e-6)")


def judge_gpt(results) -> str:
    return _judge_gpt_runs(results, "gpt")


def judge_sp(results) -> str:
    if "stub" in results[0]["sp"]:
        raise CheckFailed(results[0]["sp"]["stub"])
    for rank, r in enumerate(results):
        if "elsewhere" in r["sp"]:
            then = f" (and then: {r['sp']['then']})" if "then" in r["sp"] else ""
            ran = _ops(r["sp"]["elsewhere"])
            raise CheckFailed(f"rank {rank} (tp 2 x dp 2 on 4 ranks): the layers ran {ran} on "
                              "another group than their tp group (the world group?): pass "
                              "self.comm, the tensor-parallel group, to the sequence all-gather "
                              "and reduce-scatter too" + then)
    for rank, r in enumerate(results):
        if "error" in r["sp"]:
            raise CheckFailed(f"rank {rank}: {r['sp']['error']}\nwith sequence parallelism the column layer takes this "
                              "rank's sequence shard [b, s/t, h] and gives full-sequence features (all-gather, f_bar); "
                              "the row layer gives back a sequence shard (reduce-scatter, g_bar)")
    return _judge_gpt_runs(results, "sp")


def _judge_gpt_runs(results, phase) -> str:
    lines = []
    for rank, r in enumerate(first_phase(results, phase)):
        for key, run in r.items():
            for what in ("logits", "grads", "params"):
                w = run[what]
                if not w["atol_needed"] <= ATOL:
                    tensor = f" `{w['name']}`" if w.get("name") else ""
                    when = {"logits": "in the first forward", "grads": "after the first backward",
                            "params": f"after {GPT_STEPS} SGD steps"}[what]
                    why = ""
                    if what == "grads" and w.get("name", "").endswith("c_proj.bias") and run["logits"][
                            "atol_needed"] <= ATOL:
                        why = (": the logits are right but the gradient of a row-parallel layer's bias (c_proj) is "
                               "not: a bias added before the reduction (g, or the reduce-scatter under sequence "
                               "parallelism) is summed over the t ranks, t x the bias and t x its gradient (zero at "
                               "init, so forward hides it); add it once, after the reduction")
                    raise CheckFailed(f"{key}: rank {rank} {what[:-1] if what != 'logits' else what}{tensor} differs "
                                      f"from the single-process TinyGPT {when} (max diff {w['max_diff']:.3g}){why}")
            for p in ("forward", "backward"):
                measured = {op: v[:2] for op, v in run["collectives"][p].items()}
                if measured != run["formula"]["collectives"][p]:
                    raise CheckFailed(f"{key}: rank {rank} ran {measured} (calls, payload bytes) in {p}, expected "
                                      f"{run['formula']['collectives'][p]}")
    for key in results[0][phase]:
        lines.append(f"{key}: logits, gradients and parameters after {GPT_STEPS} SGD steps within rtol 1e-6 + "
                     f"{ATOL:g} of one process; collectives per pass as the formula")
    return "\n".join(lines)


CHECKS = [
    Check("f and g: values and collectives in forward and backward (t=4)", 2, judged_check(judge_fg, measured)),
    Check("from_linear: column (plain, fused q|k|v) and row slices (t=4)", 2, judged_check(judge_slices, measured)),
    Check("Column -> GeLU -> Row equals nn.Linear; one all-reduce per pass", 3, judged_check(judge_mlp, measured)),
    Check("TinyGPT at t=4 equals one process; collectives as the formula", 3, judged_check(judge_gpt, measured)),
    Check("stretch: sequence parallelism, TinyGPT at t=2 (SP, tied) x DDP equals one process (extra points)", 2,
          judged_check(judge_sp, measured), extra=True),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab10_tensor_parallel.py` shows."""
    from minizero.comm import Mesh
    from minizero_course.experiments.tensor import side_by_side
    for name, fn in (("f", impl.copy_to_tensor_parallel), ("g", impl.reduce_from_tensor_parallel)):
        x = torch.full((3,), float(comm.rank + 1), requires_grad=True)  # rank r holds r + 1
        y = fn(x, comm)
        y.backward(torch.ones(3))
        seen = comm.allgather_object((y[0].item(), x.grad[0].item()))
        if comm.rank == 0:
            print(f"{name} on x = rank + 1, t={comm.size}: forward gives " + ", ".join(f"{a:g}" for a, _ in seen)
                  + "; backward of ones gives " + ", ".join(f"{b:g}" for _, b in seen))
    for sp in (False, True):
        res = side_by_side(Mesh(comm, tp=comm.size), sequence_parallel=sp, column_cls=impl.ColumnParallelLinear,
                           row_cls=impl.RowParallelLinear)
        everyone = comm.allgather_object(res["params"])
        if comm.rank:
            continue
        print(f"\nTinyGPT, t={comm.size}, sequence_parallel={sp}: {len(res['losses'])} SGD steps")
        print_losses("loss (TP)", res["losses"], "1 process", res["ref_losses"], digits=6)
        print(f"largest parameter difference after the last step: {max(w['max_diff'] for w in everyone):.2g}")
        for phase in ("forward", "backward"):
            print(f"collectives in the first {phase} (calls, payload bytes): "
                  f"{ {op: v[:2] for op, v in res['collectives'][phase].items()} }")
            print(f"  expected: {res['formula']['collectives'][phase]}")
