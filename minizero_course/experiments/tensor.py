"""Tensor parallelism, measured: what lesson 10, lab 10 and tests/test_tensor.py launch.

`side_by_side(mesh, ...)` trains the single-process TinyGPT (full batch, on every rank) and its
tensor-parallel version (mesh.tp; with mesh.dp > 1 also DDP over mesh.dp, each dp rank a slice
of the batch) in lockstep with SGD, and returns what it measured in the first step and after the
last:
  * the largest atol needed (at rtol 1e-6) for the gathered logits, the loss, every gradient
    (first step) and every parameter (after the last step), each naming the worst tensor;
  * the tp group's collectives in the first forward and backward (comm.stats: calls, payload
    and bytes sent, per op), next to parallel_gpt.collectives_per_step;
  * the bytes autograd saved for backward per layer (memory.SavedTensors) next to Korthikanti's
    formula (memory.activation_bytes) + what this model keeps beyond it (unmodelled_bytes);
  * the parameter bytes the ledger finds on this rank, next to (Psi_split / t + Psi_replicated) * 4.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minizero import memory
from minizero.memory import SavedTensors
from minizero.comm import Mesh
from minizero.data import SyntheticTokens, shard
from minizero.models import GPTConfig, TinyGPT
from minizero.tensor import ColumnParallelLinear, RowParallelLinear, TensorParallelGPT, gather_full
from minizero.tensor.parallel_gpt import collectives_per_step

# 4 heads split over t = 1, 2 or 4; 16 tokens split over t with sequence parallelism; vocab 64.
GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH, LR, STEPS = 4, 0.1, 5
# Single-process names of the tensors TP splits (the rest is whole on every rank).
SPLIT = ("wte.weight", "lm_head.weight", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
         "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight")


def atol_needed(mine: torch.Tensor, ref: torch.Tensor) -> float:
    """The smallest atol for which allclose(mine, ref, rtol=1e-6, atol) holds (NaN stays NaN)."""
    excess = ((mine.float() - ref.float()).abs() - 1e-6 * ref.float().abs()).clamp_min(0).max().item()
    return float("nan") if torch.isnan(mine).any() else excess


def worst(mine: dict, ref: dict) -> dict:
    """The tensor furthest from the reference: {"name", "atol_needed", "max_diff"}."""
    out = {"name": None, "atol_needed": -1.0, "max_diff": 0.0}
    for name, r in ref.items():
        m = mine.get(name)
        if m is None or m.shape != r.shape:
            return {"name": name, "atol_needed": float("inf"), "max_diff": float("inf"),
                    "why": "missing" if m is None else f"shape {tuple(m.shape)}, expected {tuple(r.shape)}"}
        need = atol_needed(m, r)
        if not need <= out["atol_needed"]:  # NaN wins
            out = {"name": name, "atol_needed": need, "max_diff": (m - r).abs().max().item()}
    return out


def korthikanti_per_layer(seq, batch, hidden, heads, tp_size, sequence_parallel) -> float:
    """Korthikanti's formula for one layer of TinyGPT: fp32 activations, no dropout."""
    return memory.activation_bytes(batch, seq, hidden, 1, heads, bytes_per=4, tensor_parallel=tp_size,
                                   sequence_parallel=sequence_parallel, dropout=False)


def unmodelled_bytes(seq: int, batch: int, tp_size: int = 1, sequence_parallel: bool = False, bytes_per: int = 4):
    """What a TinyGPT layer keeps beyond the formula (the paper leaves these out as small): each
    LayerNorm's mean and 1/std per token, 2 * 2 * s*b*w (on s/t tokens with SP), and the boolean
    causal mask the attention's masked_fill keeps, s*s bytes, whole on every rank."""
    layer_norm_stats = 2 * 2 * seq * batch * bytes_per
    return layer_norm_stats / (tp_size if sequence_parallel else 1) + seq * seq


def split_parameter_bytes(model: torch.nn.Module, tp_size: int) -> dict:
    """The formula side of parameter memory, from the SINGLE-process model: (split / t + whole) * bytes."""
    split = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith(SPLIT))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"single_process": total, "split": split, "replicated": total - split,
            "per_rank": split / tp_size + (total - split)}


@torch.no_grad()
def sgd_step(params, lr):
    """torch.optim.SGD's update without momentum, written out: torch.optim's first step imports
    torch._dynamo, seconds in every launched rank, for what is one line here."""
    for p in params:
        if p.grad is not None:
            p.add_(p.grad, alpha=-lr)
            p.grad = None


def _stats(comm) -> dict:
    return {op: [s["calls"], s["payload_bytes"], s["sent_bytes"]] for op, s in comm.stats.as_dict().items()}


def side_by_side(mesh: Mesh, sequence_parallel=False, tied=False, steps=STEPS, batch=BATCH, lr=LR, config=None,
                 column_cls=ColumnParallelLinear, row_cls=RowParallelLinear, seed=0) -> dict:
    """Single process vs TP (x DDP over mesh.dp) in lockstep; see the module docstring."""
    from minizero.dp.ddp import DDP
    cfg = GPTConfig(**{**GPT, **(config or {}), "tie_weights": tied})
    tp_comm = mesh.tp
    ref = TinyGPT(cfg, seed=seed)
    tp_model = TensorParallelGPT(TinyGPT(cfg, seed=seed), tp_comm, sequence_parallel, column_cls, row_cls)
    model = DDP(tp_model, mesh.dp) if mesh.dp_size > 1 else tp_model
    data = SyntheticTokens(cfg.vocab_size, cfg.block_size, seed=seed)
    rows = slice(mesh.dp_rank * batch // mesh.dp_size, (mesh.dp_rank + 1) * batch // mesh.dp_size)
    out = {"t": tp_comm.size, "dp": mesh.dp_size, "sequence_parallel": sequence_parallel, "tied": tied,
           "losses": [], "ref_losses": []}
    for step in range(steps):
        x, y = data.batch(step, batch)
        x_local, y_local = shard((x, y), mesh.dp_rank, mesh.dp_size)
        ref_logits, ref_loss = ref(x, y)
        ref_loss.backward()
        tp_comm.stats.reset()
        if step == 0:
            labels = {f"h.{i}": block for i, block in enumerate(tp_model.h)}
            with SavedTensors(labels, exclude=tp_model) as saved:
                logits, loss = model(x_local, y_local)
        else:
            logits, loss = model(x_local, y_local)
        forward = _stats(tp_comm)
        tp_comm.stats.reset()
        loss.backward()
        if mesh.dp_size > 1:
            model.finish_gradient_synchronization()
        if step == 0:
            out["collectives"] = {"forward": forward, "backward": _stats(tp_comm)}
            out["saved_bytes"] = {k: v for k, v in saved.bytes.items()}
            gathered = torch.empty((tp_comm.size, *logits.shape), dtype=logits.dtype, device=logits.device)
            tp_comm.all_gather(gathered, logits.detach().contiguous())
            full_logits = torch.cat(gathered.unbind(0), dim=-1)
            local_ref = ref_logits.detach()[rows]
            ref_local_loss = F.cross_entropy(local_ref.reshape(-1, cfg.vocab_size), y_local.reshape(-1))
            out["logits"] = {"atol_needed": atol_needed(full_logits, local_ref),
                             "max_diff": (full_logits - local_ref).abs().max().item()}
            out["loss"] = [loss.item(), ref_local_loss.item()]
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            out["grads"] = worst(tp_model.gather_full(grads=True), ref_grads)
            out["parameter_bytes"] = {"ledger": memory.measure(tp_model).by_category["parameters"],
                                      **split_parameter_bytes(ref, tp_comm.size)}
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
        sgd_step(tp_model.parameters(), lr)
        sgd_step(ref.parameters(), lr)
    out["params"] = worst(gather_full(tp_model, tp_comm), dict(ref.named_parameters()))
    local_batch = batch // mesh.dp_size
    out["shape"] = {"batch": local_batch, "seq": cfg.block_size, "hidden": cfg.n_embd, "heads": cfg.n_head,
                    "tp": tp_comm.size}  # what the formulas below were evaluated at
    out["formula"] = {
        "collectives": collectives_per_step(cfg.n_layer, local_batch, cfg.block_size, cfg.n_embd, cfg.block_size,
                                            tp_comm.size, sequence_parallel, cfg.bias),
        "activation_bytes_per_layer": korthikanti_per_layer(cfg.block_size, local_batch, cfg.n_embd, cfg.n_head,
                                                            tp_comm.size, sequence_parallel),
        "unmodelled_bytes_per_layer": unmodelled_bytes(cfg.block_size, local_batch, tp_comm.size, sequence_parallel)}
    return out


# ------------------------------------------------------------------------------ one MLP, counted
def collective_calls(comm) -> dict:
    """{op: calls} from comm.stats since its last reset."""
    return {op: st["calls"] for op, st in comm.stats.as_dict().items() if st["calls"]}


def mlp_side_by_side(comm, column_cls=ColumnParallelLinear, row_cls=RowParallelLinear) -> dict:
    """Column -> GeLU -> Row over comm against nn.Linear -> GeLU -> nn.Linear (8 -> 16 -> 8): the
    collectives of each layer in each pass, and the largest excess over rtol 1e-6 of the output,
    of the input gradient and of each gathered weight gradient. (Lab 10 grades with it.)"""
    from minizero.tensor import unshard
    torch.manual_seed(1)
    fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
    g = torch.Generator().manual_seed(5)
    x_ref, weights = torch.randn(2, 6, 8, generator=g).requires_grad_(), torch.randn(2, 6, 8, generator=g)
    (fc2(F.gelu(fc1(x_ref))) * weights).sum().backward()
    col, row = column_cls.from_linear(fc1, comm), row_cls.from_linear(fc2, comm)
    x = x_ref.detach().clone().requires_grad_()
    comm.stats.reset()
    h = col(x)
    col_forward = collective_calls(comm)
    comm.stats.reset()
    z = row(F.gelu(h))
    row_forward = collective_calls(comm)
    seen = {}
    h.register_hook(lambda grad: seen.update(row=collective_calls(comm)))  # row's backward is done when dL/dh exists
    comm.stats.reset()
    (z * weights).sum().backward()
    row_backward, total = seen.get("row", {}), collective_calls(comm)
    col_backward = {op: n - row_backward.get(op, 0) for op, n in total.items() if n - row_backward.get(op, 0)}
    z_ref = fc2(F.gelu(fc1(x_ref.detach()))).detach()

    def gathered(t, dim):
        buf = torch.empty((comm.size, *t.shape))
        comm.all_gather(buf, t.contiguous())
        return unshard(list(buf.unbind(0)), dim)
    grads = {"c_fc.weight": (gathered(col.weight.grad, 0), fc1.weight.grad),
             "c_fc.bias": (gathered(col.bias.grad, 0), fc1.bias.grad),
             "c_proj.weight": (gathered(row.weight.grad, 1), fc2.weight.grad),
             "c_proj.bias": (row.bias.grad, fc2.bias.grad)}
    return {"calls": {"ColumnParallelLinear forward": col_forward, "RowParallelLinear forward": row_forward,
                      "RowParallelLinear backward": row_backward, "ColumnParallelLinear backward": col_backward},
            "z": atol_needed(z.detach(), z_ref),
            "z_extra_bias": atol_needed(z.detach(), z_ref + (comm.size - 1) * fc2.bias.detach()),
            "dx": atol_needed(x.grad, x_ref.grad), "grads": {n: atol_needed(m, r) for n, (m, r) in grads.items()}}


# ------------------------------------------------------------------------------ lesson 10
LESSON_GPT = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)  # models.GPTConfig's defaults


def saved_per_layer(comm, tp_size, sequence_parallel, batch, config=None) -> dict:
    """Bytes saved for backward by layer h.0 of a TinyGPT split over groups of tp_size ranks of comm
    (a sub-communicator per group), next to Korthikanti's formula for it."""
    cfg = GPTConfig(**{**LESSON_GPT, **(config or {})})
    group = comm.split(comm.rank // tp_size, name=f"tp{tp_size}")
    model = TensorParallelGPT(TinyGPT(cfg), group, sequence_parallel)
    x, y = SyntheticTokens(cfg.vocab_size, cfg.block_size).batch(0, batch)
    with SavedTensors({"h.0": model.h[0]}, exclude=model) as saved:
        model(x, y)
    args = (cfg.block_size, batch, cfg.n_embd, cfg.n_head, tp_size, sequence_parallel)
    return {"t": tp_size, "sp": sequence_parallel, "measured": saved.bytes["h.0"], "batch": batch,
            "seq": cfg.block_size, "hidden": cfg.n_embd, "heads": cfg.n_head,
            "formula": korthikanti_per_layer(*args),
            "unmodelled": unmodelled_bytes(cfg.block_size, batch, tp_size, sequence_parallel)}


def ddp_bytes_per_step(comm, config=None, batch=BATCH) -> dict:
    """What data parallelism sends per step on the same model: one DDP step over comm, counted."""
    from minizero.dp.ddp import DDP
    model = DDP(TinyGPT(GPTConfig(**{**GPT, **(config or {})})), comm)
    x, y = shard(SyntheticTokens(model.module.config.vocab_size, model.module.config.block_size).batch(0, batch),
                 comm.rank, comm.size)
    comm.stats.reset()
    model(x, y)[1].backward()
    model.finish_gradient_synchronization()
    return {"sent": comm.stats.sent(), "psi": sum(p.numel() for p in model.parameters()),
            "calls": sum(st["calls"] for st in comm.stats.as_dict().values())}


def describe_tp_vs_dp(tp_sent: float, dp_sent: float, tp_calls: int, dp_calls: int, fwd_calls: int) -> str:
    """Section 6's conclusion: TP's activation all-reduces against DP's gradient buckets (bytes, calls)."""
    ratio = tp_sent / dp_sent
    s = (f"TP sent {ratio:.2f}× DP's bytes here ({'fewer' if ratio < 1 else 'more'}: TP's grow with the tokens per "
         f"micro-batch, DP's with the parameters), in {tp_calls} collectives against DP's {dp_calls} bucket "
         f"all-reduce{'s' if dp_calls > 1 else ''}"
         + (f": {tp_calls - dp_calls} more latencies α. " if tp_calls > dp_calls else ". "))
    s += (f"In minizero every one of them waits for its result: the {fwd_calls} forward ones because the next "
          f"operation needs their sum, the {tp_calls - fwd_calls} backward ones because `CopyToTensorParallel` waits "
          "too. Libraries hide both kinds: Megatron-LM overlaps the backward all-reduce of a layer's input gradient "
          "with its weight-gradient GEMM (`LinearWithGradAccumulationAndAsyncCommunication`), and the forward ones too "
          "with Megatron-Core's `tp_comm_overlap` (`megatron/core/model_parallel_config.py`: Transformer Engine splits "
          "each GEMM into chunks and overlaps one chunk's all-gather or reduce-scatter with the next chunk's compute), "
          "torchtitan's `compile.enable_async_tensor_parallel` (torch's micro-pipelined all-gather-matmul and "
          "matmul-reduce-scatter) and DeepSpeed's Domino (`runtime/domino/transformer.py`: the batch split in two, one "
          "half's all-reduce launched async while the other half computes).")
    return s


def lesson(comm, batch=4):
    """Lesson 10's measurements in ONE 4-rank job (rank 0's view is what the notebook reads)."""
    from minizero_course.experiments.collectives import time_collectives
    torch.set_num_threads(1)
    out = {"mlp": mlp_side_by_side(comm)}
    mesh = Mesh(comm, tp=comm.size)
    out["layers"] = {f"L{n_layer}/sp{int(sp)}": side_by_side(mesh, sp, steps=2, config={"n_layer": n_layer})
                     for n_layer in (1, 2) for sp in (False, True)}
    out["activations"] = [saved_per_layer(comm, t, sp, batch) for t in (1, 2, 4) for sp in (False, True)
                          if t > 1 or not sp]
    out["ddp"] = ddp_bytes_per_step(comm)
    out["alpha_beta"] = time_collectives(comm, sizes_bytes=[2 ** k for k in range(10, 21, 2)],
                                         ops=("all_reduce",), repeats=5)
    return out
