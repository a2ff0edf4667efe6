"""A whole GPT turned into its t-way tensor-parallel version, loading the matching slices.

    tp_model = TensorParallelGPT(TinyGPT(config, seed=0), mesh.tp, sequence_parallel=True)
    logits_shard, loss = tp_model(idx, targets)   # every tp rank: the same idx; logits [b, s, V/t]
    loss.backward()                               # the same loss on every rank of the group
    optimizer.step()                              # each rank steps its own slices

Works on the module structure of a nanoGPT-named model (wte, wpe, h.{i}, ln_f, lm_head;
minizero.models.TinyGPT, not imported here):
  * wte -> VocabParallelEmbedding (vocab.py): g after the lookup (reduce-scatter with SP);
  * every block -> blocks.parallelize_block: 2 all-reduces per pass (2 all-gathers + 2 reduce-
    scatters forward, 4 + 2 backward, with SP);
  * lm_head -> ColumnParallelLinear over the vocabulary (tied weights stay ONE local Parameter),
    and vocab_parallel_cross_entropy: the full logits are never gathered.
Per step, on top of the layers: forward 1 all-reduce (embedding) + 2 (cross-entropy: max, then
Z and z_y together); backward 1 all-reduce (f before lm_head). With SP the embedding's all-reduce
is a reduce-scatter and lm_head's f is an all-gather (forward) and all-gather + reduce-scatter
(backward), and each replicated parameter's gradient is all-reduced once (sequence.py).

Parameter memory per rank: every matrix and the column-parallel biases are split t ways; wpe,
the LayerNorms and the row-parallel biases are whole on every rank:
    bytes = (Psi_split / t + Psi_replicated) * bytes_per_element
The parallel model is built by converting `model` IN PLACE (after every size is checked, so bad
input changes nothing) and moving it to comm.device.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from minizero.tensor.blocks import check_block, mark_replicated_sequence_parallel, parallelize_block
from minizero.tensor.layers import ColumnParallelLinear, RowParallelLinear, check_divisible, unshard
from minizero.tensor.sequence import check_sequence, sequence_shard
from minizero.tensor.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


class TensorParallelGPT(nn.Module):
    """`model`'s tensor-parallel version over the group `comm` (mesh.tp). It adopts `model`'s
    (converted) submodules, so parameter names and state_dict keys are the single-process model's
    (holding this rank's slices), and any wrapper (DDP, ZeRO-1/2/3 over mesh.dp) sees a plain
    module."""

    def __init__(self, model: nn.Module, comm, sequence_parallel: bool = False,
                 column_cls=ColumnParallelLinear, row_cls=RowParallelLinear):
        super().__init__()
        self.check(model, comm.size)
        tied = model.lm_head.weight is model.wte.weight
        self.comm = comm  # the tensor-parallel group: every rank sees the same batch
        # LayerNorms and residuals on s/t tokens per rank
        self.sequence_parallel = sequence_parallel
        self.tied = tied  # lm_head.weight IS wte.weight: one local slice, two uses
        self.block_size = model.wpe.num_embeddings  # the longest sequence
        model.wte = VocabParallelEmbedding.from_embedding(model.wte, comm,
                                                          sequence_parallel=sequence_parallel)
        for block in model.h:
            parallelize_block(block, comm, sequence_parallel, column_cls, row_cls)
        model.lm_head = column_cls.from_linear(model.lm_head, comm,
                                               sequence_parallel=sequence_parallel)
        if tied:
            model.lm_head.weight = model.wte.weight
        if sequence_parallel:  # wpe and ln_f see s/t tokens too (the blocks marked their own)
            mark_replicated_sequence_parallel(model, comm)
        # the single-process model's config, if it has one
        self.config = getattr(model, "config", None)
        for name, child in model.named_children():  # the original names: wte, wpe, h, ln_f, lm_head
            self.add_module(name, child)
        for name, tensor in [*model.named_parameters(recurse=False),
                             *model.named_buffers(recurse=False)]:
            (self.register_parameter if isinstance(tensor, nn.Parameter) else self.register_buffer)(
                name, tensor
            )
        self.to(comm.device)

    @staticmethod
    def check(model: nn.Module, t: int):
        """Every size that must divide by t (vocabulary, heads, hidden): an error naming it, nothing
        changed."""
        check_divisible("vocab_size (wte.num_embeddings)", model.wte.num_embeddings, t)
        for i, block in enumerate(model.h):
            check_block(block, t, where=f"h.{i}")

    def forward(self, idx, targets=None):
        """-> (this rank's logits [b, s, V/t], the mean loss over all tokens or None)."""
        model, comm = self, self.comm
        seq_len = idx.size(1)
        if seq_len > self.block_size:
            raise ValueError(f"sequence length {seq_len} exceeds block_size {self.block_size}")
        positions = torch.arange(seq_len, device=idx.device)
        if self.sequence_parallel:
            check_sequence(seq_len, comm.size)
            # this rank's tokens
            positions = sequence_shard(positions.unsqueeze(0), comm).squeeze(0)
        x = model.wte(idx) + model.wpe(positions)
        for block in model.h:
            x = block(x)
        logits = model.lm_head(model.ln_f(x))
        loss = vocab_parallel_cross_entropy(logits, targets, comm) if targets is not None else None
        return logits, loss

    def gather_full(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """{name: full tensor} on every rank: the parameters (or their gradients) of the single-
        process model, put together from every rank's slices (one all-gather per split tensor)."""
        return gather_full(self, self.comm, grads)

    def pipeline_parts(self) -> tuple:
        """This model cut for a pipeline (3D: pipeline stages whose layers are split over mesh.tp):
        (embed, blocks, head, loss_fn, hidden_shape), the fields of minizero.pipeline.PipelineModel.
        The same modules, so a tied lm_head stays wte's slice. Every tp rank of a stage sends its
        (replicated) hidden state to the same tp rank of the next stage: [b, s, h] through the
        pipes. Sequence parallelism would send [b, s/t, h] shards between stages: not
        implemented."""
        if self.sequence_parallel:
            raise ValueError("a pipeline of sequence-parallel stages is not implemented: the pipes "
                             "carry the whole sequence; build the TensorParallelGPT with "
                             "sequence_parallel=False")
        comm = self.comm

        def loss_fn(logits, targets):  # the full logits are never gathered, as in forward()
            return vocab_parallel_cross_entropy(logits, targets, comm)
        return (ParallelEmbed(self.wte, self.wpe), list(self.h),
                ParallelHead(self.ln_f, self.lm_head), loss_fn,
                (self.block_size, self.wpe.embedding_dim))


class ParallelEmbed(nn.Module):
    """A pipeline's first stage of a TensorParallelGPT: the vocab-parallel lookup (its g included) +
    wpe."""

    def __init__(self, wte: VocabParallelEmbedding, wpe: nn.Embedding):
        super().__init__()
        self.wte = wte  # vocab-parallel: each rank looks up its rows, then one all-reduce over tp
        self.wpe = wpe  # whole on every tp rank

    def forward(self, idx):
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class ParallelHead(nn.Module):
    """A pipeline's last stage of a TensorParallelGPT: ln_f and the column-parallel lm_head (logits
    [b, s, V/t])."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: ColumnParallelLinear):
        super().__init__()
        self.ln_f = ln_f        # whole on every tp rank
        self.lm_head = lm_head  # this rank's V/t rows of the vocabulary

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def gather_full(module: nn.Module, comm, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full parameters (or gradients; None stays None) of a tensor-parallel module, by name."""
    out = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None or not hasattr(p, "tensor_parallel_dim"):
            out[name] = None if t is None else t.detach().clone()
            continue
        gathered = torch.empty((comm.size, *t.shape), dtype=t.dtype, device=t.device)
        comm.all_gather(gathered, t.contiguous())
        out[name] = unshard(list(gathered.unbind(0)), p.tensor_parallel_dim,
                            p.tensor_parallel_chunks)
    return out


def collectives_per_step(
    n_layer: int,
    batch: int,
    seq: int,
    hidden: int,
    block_size: int,
    tp_size: int,
    sequence_parallel: bool = False,
    bias: bool = True,
    bytes_per: int = 4,
) -> dict:
    """The module docstring's count, as {"per_layer" | "forward" | "backward": {op: [calls, payload
    bytes]}}; forward/backward are whole steps (n_layer layers + embedding, head and loss). Payload
    as minizero.comm.stats counts it: an all-gather's gathered output, a reduce-scatter's full
    input."""
    act = batch * seq * hidden * bytes_per            # one [b, s, h] activation
    tokens = batch * seq * bytes_per  # one number per token (the loss's all-reduces)
    if not sequence_parallel:
        layer_fwd = {"all_reduce": [2, 2 * act]}      # g after attn.c_proj and after mlp.c_proj
        layer_bwd = {"all_reduce": [2, 2 * act]}      # f before attn.c_attn and before mlp.c_fc
        # g of the embedding; loss: max, then (Z, z_y)
        extra_fwd = {"all_reduce": [3, act + 3 * tokens]}
        extra_bwd = {"all_reduce": [1, act]}          # f before lm_head
    else:
        replicated = 6 if bias else 2  # ln_1, ln_2 (weight, bias), the two row-parallel biases
        layer_fwd = {"all_gather": [2, 2 * act], "reduce_scatter": [2, 2 * act]}
        layer_bwd = {"all_gather": [4, 4 * act], "reduce_scatter": [2, 2 * act],
                     "all_reduce": [replicated, replicated * hidden * bytes_per]}
        extra_fwd = {"reduce_scatter": [1, act], "all_gather": [1, act],
                     "all_reduce": [2, 3 * tokens]}
        ln_f = 2 if bias else 1
        extra_bwd = {"all_gather": [2, 2 * act], "reduce_scatter": [1, act],
                     # wpe, ln_f
                     "all_reduce": [1 + ln_f, (block_size + ln_f) * hidden * bytes_per]}

    def total(layer, extra):
        ops = sorted(set(layer) | set(extra))
        return {
            op: [n_layer * layer.get(op, [0, 0])[i] + extra.get(op, [0, 0])[i] for i in (0, 1)]
            for op in ops
        }
    return {"per_layer": {"forward": layer_fwd, "backward": layer_bwd},
            "forward": total(layer_fwd, extra_fwd), "backward": total(layer_bwd, extra_bwd)}
