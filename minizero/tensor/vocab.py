"""The vocabulary split over the tensor-parallel group: embedding, output layer, and a
cross-entropy that never gathers the logits.

Shoeybi et al. 2019, Sec. 3 ("parallelize the input and output embedding"). The embedding E
(V x h) is split by rows: rank r owns tokens [r*V/t, (r+1)*V/t). Each rank looks up the ids it
owns, writes zeros for the others, and g (all-reduce) sums: every token's row comes from the one
rank that owns it. With sequence parallelism the sum is a reduce-scatter instead, and each rank
keeps its s/t tokens. The output layer (lm_head, h -> V) is a ColumnParallelLinear with the same
split, so tied weights stay tied: both modules hold the same local slice of one Parameter.

Gathering the logits would move b*s*V elements. Instead the loss comes from the shards and
three numbers per token (Megatron's vocab_parallel_cross_entropy):
    m   = max over the vocabulary              (all-reduce max)
    Z   = sum_v exp(logit_v - m)               (all-reduce sum)
    z_y = logit of the target - m              (found on the one rank that owns it; 0 elsewhere)
    loss = log Z - z_y
Z and z_y travel in one all-reduce: 2 all-reduces per step, of b*s and 2*b*s elements, instead of
b*s*V. Backward needs no communication: dL/dlogit_v = softmax_v - [v == y] on each rank's slice.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minizero.tensor.layers import check_divisible, mark_sharded, reduce_from_tensor_parallel, shard
from minizero.tensor.sequence import reduce_scatter_to_sequence_parallel


def vocab_range(vocab_size: int, comm) -> tuple[int, int]:
    """[start, end) of the token ids this rank owns."""
    check_divisible("vocab_size", vocab_size, comm.size)
    per_rank = vocab_size // comm.size
    return comm.rank * per_rank, (comm.rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with the rows (vocabulary) split over the tp group. Returns the full
    embedding on every rank, or this rank's sequence shard [b, s/t, h] with sequence_parallel."""

    def __init__(self, num_embeddings: int, embedding_dim: int, comm,
                 sequence_parallel: bool = False):
        super().__init__()
        self.comm = comm                                   # the tensor-parallel group (mesh.tp)
        self.num_embeddings = num_embeddings               # the full vocabulary
        self.embedding_dim = embedding_dim
        # the ids this rank owns
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, comm)
        self.sequence_parallel = sequence_parallel  # reduce-scatter the sum along the sequence
        rows = self.vocab_end - self.vocab_start
        self.weight = mark_sharded(
            nn.Parameter(torch.empty(rows, embedding_dim, device=comm.device)), 0
        )
        with torch.no_grad():  # nn.Embedding's init of the full table, then this rank's rows
            self.load_full(nn.Embedding(num_embeddings, embedding_dim).weight)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor):
        self.weight.copy_(shard(weight, 0, self.comm.rank, self.comm.size))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, comm, **kwargs) -> "VocabParallelEmbedding":
        # the init is overwritten: leave the caller's RNG alone
        with torch.random.fork_rng(devices=[]):
            layer = cls(embedding.num_embeddings, embedding.embedding_dim, comm, **kwargs)
        layer.load_full(embedding.weight)
        return layer

    def forward(self, ids):
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.size(0))  # owned by another rank
        rows = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(
            outside.unsqueeze(-1), 0.0
        )
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(rows, self.comm)
        return reduce_from_tensor_parallel(rows, self.comm)

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim}: ids [{self.vocab_start}, "
                f"{self.vocab_end}) here, t={self.comm.size}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-sharded logits [n, V/t] and targets [n]."""

    @staticmethod
    def forward(ctx, logits, targets, comm):
        per_rank = logits.size(-1)
        start = comm.rank * per_rank
        logits_max = logits.detach().amax(dim=-1)
        comm.all_reduce(logits_max, op="max")
        shifted = logits - logits_max.unsqueeze(-1)
        local = targets - start
        outside = (local < 0) | (local >= per_rank)
        local = local.masked_fill(outside, 0)
        exp = shifted.exp()
        sums = torch.stack(
            [
                exp.sum(dim=-1),  # this rank's share of Z
                shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0),
            ]
        )
        comm.all_reduce(sums, op="sum")                           # Z and z_y in one message
        sum_exp, target_logit = sums
        # softmax of this slice
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(logits, targets, comm) -> torch.Tensor:
    """Mean cross-entropy over all tokens from [..., V/t] logit shards: what F.cross_entropy gives
    on the gathered logits, without gathering them. In fp32 whatever the logits' dtype (as Megatron
    without fp16_lm_cross_entropy): exp and the sum over V/t entries lose too much in 16 bits."""
    losses = VocabParallelCrossEntropy.apply(logits.float().reshape(-1, logits.size(-1)),
                                             targets.reshape(-1), comm)
    return losses.mean()
