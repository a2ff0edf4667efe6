"""accelerator.prepare(dataloader): each rank gets its share of the batches, as Accelerate shards them
(accelerate/data_loader.py: BatchSamplerShard without split_batches, even_batches=True, DataLoaderShard).

    batches of the original loader:   b0 b1 b2 b3 b4(short)
    rank 0 of 2:                      b0    b2    b4 + the first indices again (even_batches)
    rank 1 of 2:                         b1    b3    a batch of the first indices

Rank r takes batches r, r+n, r+2n, ...: the global batch of one step is n of the original batches, so the
same script sees the same samples per step at any rank count. A short tail is completed with the epoch's
first samples so every rank runs the same number of steps; gather_for_metrics drops those repeats again
(the loader's `remainder`). A shuffling sampler draws its order from one generator whose state rank 0
broadcasts at each epoch's start (Accelerate's synchronize_rng_states), so every rank cuts the same order.
"""
from __future__ import annotations

import torch


def shard_batches(batches: list, num_processes: int, process_index: int, batch_size, drop_last: bool) -> list:
    """BatchSamplerShard._iter_with_no_split, as a list: this rank's batches of one epoch."""
    mine, group = [], []
    for idx, batch in enumerate(batches):
        group.append(batch)
        if idx % num_processes == num_processes - 1 and (batch_size is None or len(batch) == batch_size):
            mine.append(group[process_index])
            group = []  # a group ending in a short batch (the last one) stays: the tail below
    if drop_last or not batches:
        return mine
    tail = [b for b in group if batch_size is None or len(b) == batch_size]  # full batches of a last group
    short = [b for b in group if batch_size is not None and len(b) != batch_size]
    if not group:
        return mine
    initial = [i for b in batches[:num_processes] for i in b]
    while len(initial) < num_processes * batch_size:
        initial += initial
    # the last group: its full batches, the short one completed, then batches of the first samples
    cycle = 0
    completed = list(tail)
    for b in short:
        need = batch_size - len(b)
        completed.append(list(b) + initial[cycle:cycle + need])
        cycle += need
    while len(completed) % num_processes:
        completed.append(initial[cycle:cycle + batch_size])
        cycle += batch_size
    return mine + [completed[process_index]]


class GradientState:
    """What accumulate() and gather_for_metrics read: whether this micro-batch syncs, and where the loader is."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self.sync_gradients = True
        self.end_of_dataloader = False
        self.remainder = -1             # real samples in the last global batch (-1: unknown / no repeats)
        self.active = []                # the prepared loaders being iterated, innermost last

    @property
    def in_dataloader(self) -> bool:
        return bool(self.active)


class DataLoaderShard:
    """A prepared DataLoader: this rank's batches, moved to the device, the state accumulate() reads."""

    def __init__(self, loader: torch.utils.data.DataLoader, comm, device, state: GradientState):
        self.base = loader
        self.comm, self.device, self.state = comm, device, state
        self.batch_size = loader.batch_size
        self.dataset = loader.dataset
        self.iteration = 0
        sampler = loader.sampler
        self.generator = None
        if isinstance(sampler, torch.utils.data.RandomSampler):
            if sampler.generator is None:  # Accelerate seeds one from the global RNG (rank 0's wins)
                sampler.generator = torch.Generator()
                sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
            self.generator = sampler.generator
        self.total_batch_size = (self.batch_size or 1) * comm.size

    def _sync_generator(self):
        if self.generator is None or self.comm.size == 1:
            return
        state = self.generator.get_state().to(self.comm.device)
        self.comm.broadcast(state, src=0)
        self.generator.set_state(state.cpu())

    def _batches(self) -> list:
        sampler = self.base.batch_sampler
        if sampler is None:
            raise NotImplementedError("accelerator.prepare(dataloader) with batch_size=None (an iterable dataset "
                                      "or your own batching) is not covered by minizero.accelerate: give the "
                                      "DataLoader a batch_size")
        return shard_batches([list(b) for b in sampler], self.comm.size, self.comm.rank, self.batch_size,
                             self.base.drop_last)

    def __len__(self) -> int:
        n = len(self.base)
        if self.base.drop_last:
            return n // self.comm.size
        return -(-n // self.comm.size)

    def set_epoch(self, epoch: int):
        self.iteration = epoch
        if hasattr(self.base.sampler, "set_epoch"):
            self.base.sampler.set_epoch(epoch)

    def __iter__(self):
        self._sync_generator()
        state = self.state
        state.end_of_dataloader = False
        state.remainder = -1 if self.base.drop_last else len(self.dataset) % self.total_batch_size
        state.active.append(self)
        batches = self._batches()
        collate = self.base.collate_fn
        try:
            for k, indices in enumerate(batches):
                state.end_of_dataloader = k == len(batches) - 1
                yield _to(collate([self.dataset[i] for i in indices]), self.device)
        finally:
            state.active.remove(self)
            self.iteration += 1


def _to(batch, device):
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, dict):
        return type(batch)({k: _to(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch
