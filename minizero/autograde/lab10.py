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
             (minizero.experiments.tensor.side_by_side with your classes)
A phase that raises in your code is recorded (with the error) and the next phase runs; the ranks
agree on errors before any collective, so a crash is a failed check, never a hang.
"""
from __future__ import annotations

import importlib.util
import sys

import torch
import torch.nn as nn

from minizero.autograde import Check, CheckFailed, Lab, print_losses

LAB = Lab(10, "tensor_parallel", "Tensor parallelism: f/g, column- and row-parallel linear",
          "minizero/tensor/layers.py")

ATOL = 2e-7  # at rtol 1e-6: only the order of float32 additions differs from one process
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


# ------------------------------------------------------------------------------ the phases
def fg_phase(comm, mod):
    from minizero.experiments.tensor import atol_needed, collective_calls
    out = {}
    for name, fn in (("f", mod.copy_to_tensor_parallel), ("g", mod.reduce_from_tensor_parallel)):
        x = _data(10 + comm.rank, 3, 5).requires_grad_()
        dy = _data(20 + comm.rank, 3, 5)
        xs = torch.stack([_data(10 + r, 3, 5) for r in range(comm.size)])   # every rank's x
        dys = torch.stack([_data(20 + r, 3, 5) for r in range(comm.size)])  # and dy
        comm.stats.reset()
        y = fn(x, comm)
        forward = collective_calls(comm)
        comm.stats.reset()
        y.backward(dy)
        backward = collective_calls(comm)
        want_y, want_dx = (x.detach(), dys.sum(0)) if name == "f" else (xs.sum(0), dy)
        out[name] = {"forward": forward, "backward": backward,
                     "y": atol_needed(y.detach(), want_y), "y_is_mean": atol_needed(y.detach(), want_y / comm.size),
                     "dx": atol_needed(x.grad, want_dx), "dx_is_mean": atol_needed(x.grad, want_dx / comm.size)}
    return out


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


def mlp_phase(comm, mod):
    from minizero.experiments.tensor import mlp_side_by_side
    return mlp_side_by_side(comm, mod.ColumnParallelLinear, mod.RowParallelLinear)


def gpt_phase(comm, mod):
    from minizero.comm import Mesh
    from minizero.experiments.tensor import side_by_side
    classes = {"column_cls": mod.ColumnParallelLinear, "row_cls": mod.RowParallelLinear}
    out = {"t4": side_by_side(Mesh(comm, tp=4), steps=GPT_STEPS, **classes)}
    out["t2-sp-ddp"] = side_by_side(Mesh(comm, tp=2), sequence_parallel=True, tied=True, steps=GPT_STEPS, **classes)
    return out


def _has_error(result) -> bool:
    return isinstance(result, dict) and ("error" in result or any(_has_error(v) for v in result.values()))


PHASES = {"fg": fg_phase, "slices": slices_phase, "mlp": mlp_phase, "gpt": gpt_phase}


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
            if name in ("mlp", "gpt") and broken:  # an error in from_linear may be on some ranks only
                res[name] = {"error": "skipped: building the layers failed (see the slices check)"}
                continue
            res[name] = _phase(comm, lambda fn=fn: fn(comm, mod))
    return out


_measured: dict = {}


def measured(impl: str) -> dict:
    """One 4-rank run per file, shared by the checks (a stub's error is shared too)."""
    from minizero import launch
    if impl not in _measured:
        try:
            _measured[impl] = launch.run("minizero.autograde.lab10:measure_worker", nprocs=4,
                                         args={"impls": [impl]}, timeout=180)
        except launch.LaunchError as e:
            _measured[impl] = e
    if isinstance(_measured[impl], Exception):
        raise _measured[impl]
    return [r[impl] for r in _measured[impl]]


# ------------------------------------------------------------------------------ the judges
def _first(results, phase):
    """The phase's result on each rank; an error in it fails the check with that error."""
    for rank, r in enumerate(results):
        if "error" in r[phase]:
            raise CheckFailed(f"rank {rank}: {r[phase]['error']}")
    return [r[phase] for r in results]


def _ops(calls: dict) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(calls.items())) or "no collective"


def judge_fg(results) -> str:
    t = len(results)
    for rank, r in enumerate(_first(results, "fg")):
        f, g = r["f"], r["g"]
        if f["forward"]:
            swapped = " (f and g swapped?)" if not g["forward"] else ""
            raise CheckFailed(f"f ran {_ops(f['forward'])} in forward, expected none: f is the identity in forward "
                              f"(every rank already holds the whole input); its all-reduce belongs to backward{swapped}")
        if f["y"] > 0:
            raise CheckFailed(f"rank {rank}: f's forward changed its input (max diff {f['y']:.3g}): return it as it is")
        if f["backward"] != {"all_reduce": 1}:
            raise CheckFailed(f"f ran {_ops(f['backward'])} in backward, expected 1 all_reduce: f's backward must sum "
                              "the partial input gradients of the t ranks (missing all-reduce in backward?)")
        if f["dx"] > ATOL:
            why = ("the average: all-reduce with op='sum', not 'avg'" if f["dx_is_mean"] <= ATOL
                   else "not the sum of every rank's gradient")
            raise CheckFailed(f"rank {rank}: f's backward returned {why} (max diff {f['dx']:.3g}, t={t})")
        if g["forward"] != {"all_reduce": 1}:
            raise CheckFailed(f"g ran {_ops(g['forward'])} in forward, expected 1 all_reduce (the sum of the partial "
                              "results)")
        if g["y"] > ATOL:
            why = ("the average of the ranks' inputs: all-reduce with op='sum' (averaging instead of summing)"
                   if g["y_is_mean"] <= ATOL else "not the sum of every rank's input")
            raise CheckFailed(f"rank {rank}: g's forward returned {why} (max diff {g['y']:.3g}, t={t})")
        if g["backward"]:
            raise CheckFailed(f"g ran {_ops(g['backward'])} in backward, expected none: g is the identity in backward "
                              "(the gradient of a sum is the same on every rank)")
        if g["dx"] > 0:
            raise CheckFailed(f"rank {rank}: g's backward changed the gradient (max diff {g['dx']:.3g}): pass it through")
    return f"f: identity forward, 1 all-reduce (sum) backward; g: 1 all-reduce (sum) forward, identity backward (t={t})"


def judge_slices(results) -> str:
    t = len(results)
    for rank, r in enumerate(_first(results, "slices")):
        for name, rows, what in (("column", 12, "rows (output features, dim 0)"),
                                 ("fused", 24, "rows (output features, dim 0)"),
                                 ("row", 12, "columns (input features, dim 1)")):
            layer = "RowParallelLinear" if name == "row" else "ColumnParallelLinear" + ("(chunks=3)" if name == "fused" else "")
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
                raise CheckFailed(f"rank {rank}: RowParallelLinear's bias is not nn.Linear's whole bias: the row-parallel "
                                  "bias is not split (it is added once, to the summed output)")
            if name != "row" and res["bias_held"] != want:
                raise CheckFailed(f"rank {rank}: {layer} holds bias elements {res['bias_held']}, expected {want}: slice "
                                  "the bias like the weight's rows")
    return f"column (plain and fused q|k|v) and row layers hold the right slices of nn.Linear on each of {t} ranks"


def judge_mlp(results) -> str:
    t = len(results)
    for rank, r in enumerate(_first(results, "mlp")):
        c = r["calls"]
        column, row = c["ColumnParallelLinear forward"], c["RowParallelLinear forward"]
        swapped = " (f and g swapped?)" if column and not row.get("all_reduce") else ""
        for where, want, why in (
                ("ColumnParallelLinear forward", {}, "f is the identity in forward"),
                ("RowParallelLinear forward", {"all_reduce": 1}, "g sums the partial products once"),
                ("RowParallelLinear backward", {}, "g is the identity in backward"),
                ("ColumnParallelLinear backward", {"all_reduce": 1}, "f's backward sums dL/dx over the ranks")):
            if c[where] != want:
                raise CheckFailed(f"{where}: {_ops(c[where])}, expected {_ops(want)}: {why}{swapped}")
        if r["z"] > ATOL:
            if r["z_extra_bias"] <= ATOL:
                raise CheckFailed(f"rank {rank}: the MLP output is nn.Linear's + (t-1) x bias: the row-parallel bias was "
                                  "added on every rank before the sum; add it once, after g")
            raise CheckFailed(f"rank {rank}: the MLP output differs from nn.Linear's (max excess {r['z']:.3g} over rtol 1e-6)")
        if r["dx"] > ATOL:
            raise CheckFailed(f"rank {rank}: the input gradient differs from nn.Linear's (excess {r['dx']:.3g})")
        for name, excess in r["grads"].items():
            if excess > ATOL:
                raise CheckFailed(f"rank {rank}: the gradient of {name} (gathered) differs from nn.Linear's "
                                  f"(excess {excess:.3g} over rtol 1e-6)")
    return (f"Column -> GeLU -> Row equals nn.Linear -> GeLU -> nn.Linear to rtol 1e-6 + {ATOL:g} (output, input and "
            f"weight gradients); 1 all-reduce forward (row), 1 backward (column), t={t}")


def judge_gpt(results) -> str:
    lines = []
    for rank, r in enumerate(_first(results, "gpt")):
        for key, run in r.items():
            for what in ("logits", "grads", "params"):
                w = run[what]
                if not w["atol_needed"] <= ATOL:
                    tensor = f" `{w['name']}`" if w.get("name") else ""
                    when = {"logits": "in the first forward", "grads": "after the first backward",
                            "params": f"after {GPT_STEPS} SGD steps"}[what]
                    raise CheckFailed(f"{key}: rank {rank} {what[:-1] if what != 'logits' else what}{tensor} differs "
                                      f"from the single-process TinyGPT {when} (max diff {w['max_diff']:.3g})")
            for phase in ("forward", "backward"):
                measured = {op: v[:2] for op, v in run["collectives"][phase].items()}
                if measured != run["formula"]["collectives"][phase]:
                    raise CheckFailed(f"{key}: rank {rank} ran {measured} (calls, payload bytes) in {phase}, expected "
                                      f"{run['formula']['collectives'][phase]}")
    for key, run in results[0]["gpt"].items():
        lines.append(f"{key}: logits, gradients and parameters after {GPT_STEPS} SGD steps within rtol 1e-6 + "
                     f"{ATOL:g} of one process; collectives per pass as the formula")
    return "\n".join(lines)


def _check(judge):
    def check(impl):
        return judge(measured(impl))
    check.__name__ = judge.__name__.replace("judge_", "check_")
    return check


CHECKS = [
    Check("f and g: values and collectives in forward and backward (t=4)", 2, _check(judge_fg)),
    Check("from_linear: column (plain, fused q|k|v) and row slices (t=4)", 2, _check(judge_slices)),
    Check("Column -> GeLU -> Row equals nn.Linear; one all-reduce per pass", 3, _check(judge_mlp)),
    Check("TinyGPT at t=4 and t=2 (SP, tied) x DDP equals one process", 3, _check(judge_gpt)),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab10_tensor_parallel.py` shows."""
    from minizero.comm import Mesh
    from minizero.experiments.tensor import side_by_side
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
