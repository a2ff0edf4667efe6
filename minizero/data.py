"""Deterministic synthetic data, and the one rule for splitting it across ranks.

The global batch of step s is a pure function of (seed, s, batch_size): every rank
can build it locally (no data loader, no broadcast) and take its own slice with
shard(). That is what makes "DDP on 4 ranks == one process on the full batch" a
testable statement rather than a hope.
"""
import math

import numpy as np
import torch

# Independent random streams, so the chain, the batches and the regression data of
# one seed never share random numbers.
_CHAIN, _TOKENS, _REG_MAP, _REG_X = range(4)


def _rng(seed: int, stream: int, step: int = 0) -> np.random.Generator:
    """A generator for exactly this (seed, stream, step), the same in every process.

    Why numpy and not torch.Generator: torch's CPU generator keeps only the low 32
    bits of manual_seed(), so packing (seed, step) into one integer silently
    collides (seed 1 would draw seed 0's batches). numpy's SeedSequence mixes a list of
    integers of any size, deterministically, without Python's per-process salted
    hash(). The draws are then plain float64 arrays handed to torch."""
    if min(seed, step) < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    return np.random.default_rng([stream, seed, step])


class SyntheticTokens:
    """Sequences from a fixed random sparse Markov chain over the vocabulary.

    Each token has 2 or 3 likely successors, so there is real structure to learn,
    and the best possible loss is known exactly: the chain's entropy rate
    (entropy()). The model starts near ln(vocab_size) and should fall toward it.
    """

    def __init__(self, vocab_size: int = 64, block_size: int = 32, seed: int = 0):
        self.vocab_size, self.block_size, self.seed = vocab_size, block_size, seed
        V, rng = vocab_size, _rng(seed, _CHAIN)
        P = torch.zeros(V, V, dtype=torch.float64)
        # One successor of each token follows a random cycle through all tokens:
        # every token is reachable from every other, so the stationary distribution
        # is unique and no token is left out of training.
        order = rng.permutation(V)
        cycle_next = np.empty(V, dtype=np.int64)
        cycle_next[order] = np.roll(order, -1)
        for i in range(V):
            k = min(int(rng.integers(2, 4)), V)  # 2 or 3 successors (fewer if V is tiny)
            others = [int(j) for j in rng.permutation(V) if j != cycle_next[i]]
            succ = [int(cycle_next[i])] + others[: k - 1]
            # weights in [0.5, 1.5): no near-zero successor
            w = torch.from_numpy(rng.random(k)) + 0.5
            P[i, succ] = w / w.sum()
        self.P = P  # P[i, j] = probability that token j follows token i
        # Stationary distribution pi = pi P, by power iteration on the lazy chain
        # (P + I)/2 (same pi, and laziness rules out periodic oscillation). Not
        # torch.linalg.lstsq: LAPACK returned pi differing in the last bit from call
        # to call, and pi feeds the sampler. This loop is plain elementwise math and
        # stops at an exact fixed point (158 iterations, ~1 ms, for the default chain).
        Q = (P + torch.eye(V, dtype=torch.float64)) / 2
        pi = torch.full((V,), 1.0 / V, dtype=torch.float64)
        for _ in range(10_000):
            new = (pi[:, None] * Q).sum(0)
            if torch.equal(new, pi):
                break
            pi = new
        self.pi = pi / pi.sum()
        # Sampling by inverse CDF from uniform draws: explicit, and a pure function of
        # the draws (torch.multinomial's algorithm is an implementation detail).
        self._start_cdf = self.pi.cumsum(0)
        self._cdf = P.cumsum(1)
        self._start_cdf[-1] = 1.0
        self._cdf[:, -1] = 1.0

    def entropy(self) -> float:
        """Entropy rate in nats: sum_i pi_i H(P[i]), the loss floor.

        Sequences start from pi, so every position's token is pi-distributed and
        the best next-token loss is this value at every position, not only on
        average."""
        plogp = torch.where(self.P > 0, self.P * self.P.log(), torch.zeros_like(self.P))
        return float(-(self.pi * plogp.sum(1)).sum())

    def batch(self, step: int, batch_size: int):
        """The global batch of `step`: x, y int64 [batch_size, block_size], y = x shifted by one."""
        # Drawn as [B, T+1] so that a smaller batch is a prefix of a larger one, then
        # stored time-major so each position's column is contiguous for searchsorted.
        u = _rng(self.seed, _TOKENS, step).random((batch_size, self.block_size + 1))
        u = torch.from_numpy(np.ascontiguousarray(u.T))
        seq = torch.empty(batch_size, self.block_size + 1, dtype=torch.long)
        # right=True picks the first j with cdf[j] > u: never a zero-probability token,
        # and always < vocab_size because u < 1 = cdf[-1].
        seq[:, 0] = torch.searchsorted(self._start_cdf, u[0], right=True)
        for t in range(self.block_size):
            cdf = self._cdf[seq[:, t]]  # [B, V]: each row's own next-token distribution
            seq[:, t + 1] = torch.searchsorted(cdf, u[t + 1].unsqueeze(1), right=True).squeeze(1)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def shard(batch, rank: int, world_size: int):
    """This rank's contiguous slice of dim 0: rows [rank*b, (rank+1)*b), b = B // world_size.

    Works on one tensor or a tuple/list of them (x, y). Returns views, no copies.
    Refuses uneven splits: with unequal shards, averaging the ranks' mean losses is
    no longer the mean over the global batch, and DDP would silently train on a
    different objective than the single-process baseline."""
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard(t, rank, world_size) for t in batch)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    B = batch.shape[0]
    if B % world_size:
        raise ValueError(f"global batch {B} does not divide over {world_size} ranks; "
                         f"use a multiple of {world_size}")
    b = B // world_size
    return batch[rank * b : (rank + 1) * b]


def regression_batch(step: int, batch_size: int, in_dim: int, out_dim: int, seed: int = 0):
    """(x, y) float32 for models.MLP: y = tanh(x W) with a fixed random W of this seed.

    Learnable but not linear, so the hidden layers have work to do."""
    W = torch.from_numpy(
        _rng(seed, _REG_MAP).standard_normal((in_dim, out_dim))
    ).float() / math.sqrt(in_dim)
    x = torch.from_numpy(_rng(seed, _REG_X, step).standard_normal((batch_size, in_dim))).float()
    return x, torch.tanh(2.0 * x @ W)
