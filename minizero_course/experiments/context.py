"""Context parallelism, measured: what lesson 12, lab 11 and tests/test_context.py launch.

`attention_side_by_side(cp_comm, method, causal, balanced)` runs torch's scaled_dot_product_attention
on the whole sequence (every rank, one process's answer) and ring attention or Ulysses on this
rank's shard, then returns what it measured:
  * the largest atol needed (at rtol 1e-6) of the gathered output and of dq, dk, dv;
  * the bytes the cp group sent in forward and in backward (comm.stats), next to the formulas
    ring_bytes_per_layer / ulysses_bytes_per_layer;
  * the bytes autograd kept for backward (memory.SavedTensors) next to attention_activation_bytes;
  * ring attention's BlockWork (scores computed per pass, pairs by kind, compute and wait seconds)
    next to layout.scores_per_rank.
`activation_sweep` measures the saved bytes per rank over sequence lengths; `longest_sequence`
searches the longest sequence whose measured saved bytes fit under a cap.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minizero.context import (
    BlockWork,
    attention_activation_bytes,
    online_softmax,
    ring_attention,
    ring_bytes_per_layer,
    scores_per_rank,
    shard_sequence,
    ulysses_attention,
    ulysses_bytes_per_layer,
    unshard_sequence,
)
from minizero_course.experiments.tensor import atol_needed
from minizero.memory import SavedTensors

SHAPE = {"batch": 2, "heads": 4, "seq": 32, "head_dim": 8}  # 32 tokens: 2 x cp chunks for cp = 2 and 4


def inputs(batch, heads, seq, head_dim, dtype=torch.float32, seed=0):
    """q, k, v and the output gradient of the whole sequence, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq, head_dim, generator=g).to(dtype) for _ in range(4)]


def _gather(comm, shard: torch.Tensor, balanced: bool) -> torch.Tensor:
    buf = torch.empty(comm.size * shard.numel(), dtype=shard.dtype)  # flat: gloo wants [world * numel]
    comm.all_gather(buf, shard.contiguous().view(-1))
    return unshard_sequence(list(buf.view(comm.size, *shard.shape).unbind(0)), balanced)


def _sent(comm) -> dict:
    return {op: s["sent_bytes"] for op, s in comm.stats.as_dict().items() if s["calls"]}


def run_attention(comm, method: str, q, k, v, causal: bool, balanced: bool, work=None, kernels=online_softmax,
                  ring=None):
    """`ring`: the ring_attention to run (lab 11 passes the student's), the package's by default."""
    if method == "ring":
        return (ring or ring_attention)(q, k, v, comm, causal=causal, balanced=balanced, work=work, kernels=kernels)
    return ulysses_attention(q, k, v, comm, causal=causal)


def attention_side_by_side(comm, method: str = "ring", causal: bool = True, balanced: bool = True,
                           dtype=torch.float32, kernels=online_softmax, ring=None, **shape) -> dict:
    shape = {**SHAPE, **shape}
    balanced = balanced and method == "ring"  # Ulysses needs contiguous shards (it has no imbalance)
    q, k, v, grad_out = inputs(**shape, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    ref.backward(grad_out)
    mine = [shard_sequence(t, comm.rank, comm.size, balanced).clone().requires_grad_() for t in (q, k, v)]
    work = BlockWork()
    comm.stats.reset()
    with SavedTensors() as saved:
        out = run_attention(comm, method, *mine, causal, balanced, work, kernels, ring)
    forward = _sent(comm)
    comm.stats.reset()
    out.backward(shard_sequence(grad_out, comm.rank, comm.size, balanced))
    backward = _sent(comm)
    full = {"out": _gather(comm, out.detach(), balanced)}
    full.update({f"d{n}": _gather(comm, t.grad, balanced) for n, t in zip("qkv", mine)})
    want = {"out": ref.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}
    batch, heads, seq, head_dim = (shape[n] for n in ("batch", "heads", "seq", "head_dim"))
    w, hidden, cp = torch.finfo(dtype).bits // 8, heads * head_dim, comm.size
    formula = ring_bytes_per_layer if method == "ring" else ulysses_bytes_per_layer
    return {"atol_needed": {n: atol_needed(full[n], want[n]) for n in want},
            "max_diff": {n: (full[n] - want[n]).abs().max().item() for n in want},
            "sent": {"forward": forward, "backward": backward},
            "formula": {**formula(batch, seq, hidden, cp, w),
                        "saved_bytes": attention_activation_bytes(batch, seq, hidden, heads, cp, w),
                        "scores_per_rank": scores_per_rank(seq, cp, causal, balanced)},
            "saved_bytes": saved.total, "work": work.as_dict(), "cp": cp, "rank": comm.rank}


def saved_bytes(comm, method: str, seq: int, causal: bool = True, batch=1, heads=4, head_dim=16) -> int:
    """Bytes autograd keeps for backward on this rank for one attention over `seq` tokens
    (comm.size == 1 and method 'sdpa': one process). Measured, never computed from the formula."""
    balanced = method == "ring" and causal
    q, k, v, _ = inputs(batch, heads, seq, head_dim)
    if method == "sdpa":
        mine = [t.requires_grad_() for t in (q, k, v)]
    else:
        mine = [shard_sequence(t, comm.rank, comm.size, balanced).requires_grad_() for t in (q, k, v)]
    with SavedTensors() as saved:
        out = (F.scaled_dot_product_attention(*mine, is_causal=causal) if method == "sdpa"
               else run_attention(comm, method, *mine, causal, balanced))
    del out
    return saved.total


def activation_sweep(comm, seqs=(256, 512, 1024, 2048), methods=("ring", "ulysses")) -> dict:
    """{method: {seq: saved bytes on this rank}}; 'sdpa' is one process on the whole sequence."""
    out = {"sdpa": {s: saved_bytes(comm, "sdpa", s) for s in seqs}}
    for method in methods:
        out[method] = {s: saved_bytes(comm, method, s) for s in seqs}
    return out


def longest_sequence(comm, method: str, cap_bytes: int, step: int = 16, start: int = 256, limit: int = 1 << 16) -> dict:
    """The longest multiple of `step` tokens whose MEASURED saved bytes per rank (the most over the
    ranks) fit in cap_bytes: doubling, then bisection. Every probe is a real forward."""
    def fits(seq):
        used = max(comm.allgather_object(saved_bytes(comm, method, seq)))
        probes.append((seq, used))
        return used <= cap_bytes
    probes: list = []
    low, high = 0, start
    while high <= limit and fits(high):
        low, high = high, high * 2
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    return {"method": method, "cp": comm.size, "cap_bytes": cap_bytes, "longest": low, "probes": probes}


# ------------------------------------------------------------------------------ lesson 12
LESSON_SHAPE = {"batch": 1, "heads": 8, "seq": 512, "head_dim": 16}  # hidden 128, fp32
SWEEP = (256, 512, 1024, 2048)
CAP_BYTES = 1 << 19  # 512 KiB of saved attention activations per rank


def work_per_rank(comm, seq=2048, heads=4, head_dim=16, repeats=2) -> dict:
    """Causal ring attention, contiguous and load-balanced: scores and CPU seconds of block compute
    (forward + backward) on this rank, the best of `repeats` runs."""
    out = {}
    for balanced in (False, True):
        best = None
        for _ in range(repeats):
            q, k, v, grad_out = inputs(1, heads, seq, head_dim)
            mine = [shard_sequence(t, comm.rank, comm.size, balanced).requires_grad_() for t in (q, k, v)]
            work = BlockWork()
            ring_attention(*mine, comm, causal=True, balanced=balanced, work=work).backward(
                shard_sequence(grad_out, comm.rank, comm.size, balanced))
            best = work if best is None or work.compute_s < best.compute_s else best
        out["balanced" if balanced else "contiguous"] = best.as_dict()
    out["formula"] = {name: scores_per_rank(seq, comm.size, True, name == "balanced")
                      for name in ("contiguous", "balanced")}
    return out


def lesson_worker(comm) -> dict:
    """Everything lesson 12 shows, from one 4-rank job: cp = 4, then cp = 2 (x dp 2)."""
    from minizero.comm import Mesh
    torch.set_num_threads(1)
    out = {"sweep": {"cp1": activation_sweep(comm, SWEEP, methods=())["sdpa"]}, "bytes": {}, "correct": {},
           "longest": {"cp1": longest_sequence(comm.split(comm.rank, name="one"), "sdpa", CAP_BYTES)}}
    for cp in (4, 2):
        mesh = Mesh(comm, cp=cp)
        for method in ("ring", "ulysses"):
            r = attention_side_by_side(mesh.cp, method, True, True, **LESSON_SHAPE)
            out["bytes"][f"{method}/cp{cp}"] = {"sent": r["sent"], "formula": r["formula"]}
            out["correct"][f"{method}/cp{cp}"] = r["max_diff"]
        sweep = activation_sweep(mesh.cp, SWEEP, methods=("ring", "ulysses"))
        out["sweep"].update({f"ring/cp{cp}": sweep["ring"], f"ulysses/cp{cp}": sweep["ulysses"]})
        out["longest"][f"cp{cp}"] = longest_sequence(mesh.cp, "ring", CAP_BYTES)
        if cp == 4:
            out["work"] = work_per_rank(mesh.cp)
    out["formula_per_token"] = attention_activation_bytes(1, 1, 4 * 16, 4, 1, 4)  # sweep shape: 4 heads x 16
    return out


# ------------------------------------------------------------------------------ the peer
def torch_context_parallel(comm) -> dict:
    """torch's own ring attention, `torch.distributed.tensor.experimental.context_parallel`, on this
    world (launched with backend="torch": gloo on CPU), causal, against single-process attention. Per
    SDPA backend: {"max_diff": {...}} if it ran, else {"error": the first error it raised}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel
    mesh = init_device_mesh(comm.device.type, (comm.size,), mesh_dim_names=("cp",))
    q, k, v, grad_out = inputs(**SHAPE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True)
    ref.backward(grad_out)
    out = {}
    for backend in ("FLASH_ATTENTION", "MATH"):
        buffers = [t.clone() for t in (q, k, v, grad_out)]
        try:
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
                mine = [t.requires_grad_() for t in buffers[:3]]
                try:
                    with sdpa_kernel(getattr(SDPBackend, backend)):
                        y = F.scaled_dot_product_attention(*mine, is_causal=True)
                    y.backward(buffers[3])
                finally:
                    grads = [t.grad for t in mine]
                    for t in mine:  # context_parallel resizes its buffers back on exit: plain tensors again
                        t.requires_grad_(False)
            full = context_parallel_unshard(mesh, [y.detach(), *grads], [2, 2, 2, 2])
            want = [ref.detach()] + [t.grad for t in leaves]
            out[backend] = {"max_diff": {n: (a - b).abs().max().item()
                                         for n, a, b in zip(("out", "dq", "dk", "dv"), full, want)}}
        except Exception as e:  # noqa: BLE001 - what torch raised is the result
            out[backend] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
    return out
