"""minizero.dp.data_parallel: the old single-process DataParallel, to see why DDP replaced it.

One process holds n replicas of the model (on GPUs they would be one per device; here
they are all on the CPU). Each step:

    out = dp(x, y)          # scatter the batch along dim 0, run each replica on its
                            # slice, gather the outputs to replica 0
    out[1].backward()       # one backward through all n graphs
    dp.reduce_gradients()   # replica 0's .grad = the sum of all replicas' grads
    optimizer.step()        # an optimizer over dp.module (= replica 0) only
    dp.sync_replicas()      # copy replica 0's new weights (and buffers) into the others

Why it is slow, and why torch deprecated nn.DataParallel in favour of DDP:
  * one Python process drives every replica: the replicas run one after another here,
    and even with threads they would queue on the GIL;
  * replica 0 is a hub: every gradient flows into it and every weight out of it, every
    step, so its link and memory carry n times the traffic of the others (a ring
    all-reduce spreads that evenly, see minizero/comm/stats.py);
  * the weights are re-sent every step (sync_replicas), where DDP sends only gradients.
It is still exactly right: the gathered loss is the mean of the replica losses, which on
equal slices is the mean over the whole batch, so the summed gradient is the full-batch
gradient and training equals one process on the full batch (up to summation order).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, n_replicas: int):
        super().__init__()
        if n_replicas < 1:
            raise ValueError(f"n_replicas must be >= 1, got {n_replicas}")
        self.module = module  # replica 0: the one the optimizer updates
        # Plain list, not nn.ModuleList: the copies are not parameters of this wrapper,
        # so an optimizer over dp.parameters() sees replica 0 only.
        # deepcopy keeps ties inside each copy (its memo maps a shared Parameter once).
        self.replicas = [module] + [copy.deepcopy(module) for _ in range(n_replicas - 1)]

    def forward(self, *inputs):
        n = len(self.replicas)
        for t in inputs:
            if t.shape[0] % n:
                raise ValueError(
                    f"batch of {t.shape[0]} rows does not split evenly over {n} "
                    "replicas: the mean of unequal slices' means is not the batch mean"
                )
        slices = zip(*[t.chunk(n) for t in inputs])  # scatter along dim 0
        outputs = [replica(*s) for replica, s in zip(self.replicas, slices)]
        return _gather(outputs)

    @torch.no_grad()
    def reduce_gradients(self):
        """Sum every replica's gradients into replica 0's. Each replica's loss entered the
        gathered loss with weight 1/n, so its gradient already carries the 1/n: a plain
        sum is the mean. A replica without a gradient for a parameter adds nothing."""
        for p0, *copies in zip(*[r.parameters() for r in self.replicas]):
            for p in copies:
                if p.grad is not None:
                    p0.grad = p.grad.clone() if p0.grad is None else p0.grad.add_(p.grad)
                    p.grad = None  # the copies' grads were used once; the next step starts clean

    @torch.no_grad()
    def sync_replicas(self):
        """Copy replica 0's weights and buffers into the others (call after optimizer.step())."""
        src = list(self.module.parameters()) + list(self.module.buffers())
        for r in self.replicas[1:]:
            for s, d in zip(src, list(r.parameters()) + list(r.buffers())):
                d.copy_(s)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)  # keys without a wrapper prefix

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        out = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        self.sync_replicas()
        return out


def _gather(outputs):
    """Outputs of the replicas -> one output, as if one model had seen the whole batch:
    batched tensors are concatenated along dim 0, scalars (the per-slice mean losses)
    are averaged, tuples and lists are gathered element by element."""
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, (tuple, list)):
        return type(first)(_gather(list(parts)) for parts in zip(*outputs))
    if torch.is_tensor(first):
        return torch.stack(outputs).mean(0) if first.dim() == 0 else torch.cat(outputs)
    raise TypeError(f"cannot gather replica outputs of type {type(first).__name__}")
