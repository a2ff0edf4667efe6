"""accelerator.prepare(dataloader): each rank gets its share of the batches, as Accelerate shards
them (accelerate/data_loader.py: prepare_data_loader, BatchSamplerShard without split_batches,
even_batches=True, SeedableRandomSampler, DataLoaderShard).

    batches of the original loader:   b0 b1 b2 b3 b4(short)
    rank 0 of 2:                      b0    b2    b4 + the first indices again (even_batches)
    rank 1 of 2:                         b1    b3    a batch of the first indices

Rank r takes batches r, r+n, r+2n, ...: the global batch of one step is n of the original batches,
so the same script sees the same samples per step at any rank count. A short tail is completed with
the epoch's first samples so every rank runs the same number of steps; gather_for_metrics drops
those repeats again (the loader's `remainder`).

The prepared loader is a torch DataLoader over the same dataset, collate_fn, workers and generator,
built and iterated as Accelerate's, so it draws from torch's global generator exactly when
Accelerate's does (one seed per epoch for the workers, one per epoch for an unseeded RandomSampler,
one at prepare() for the sampler's generator with several ranks). Then the same seed gives the same
order, and the same dropout masks and augmentations after it, as Accelerate: a shuffle with several
ranks draws from one generator whose state rank 0 broadcasts at each epoch's start (Accelerate's
rng_types=["generator"]); use_seedable_sampler reseeds it with data_seed (default
torch.initial_seed()) + epoch.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

# the DataLoader arguments Accelerate carries over to the prepared loader, with torch's defaults
_LOADER_KWARGS = {"num_workers": 0, "collate_fn": None, "pin_memory": False, "timeout": 0,
                  "worker_init_fn": None, "multiprocessing_context": None, "generator": None,
                  "prefetch_factor": 2, "persistent_workers": False, "pin_memory_device": ""}


def shard_batches(
    batches: list, num_processes: int, process_index: int, batch_size, drop_last: bool
) -> list:
    """BatchSamplerShard._iter_with_no_split, as a list: this rank's batches of one epoch."""
    return list(iter_shard(batches, num_processes, process_index, batch_size, drop_last))


def iter_shard(batches, num_processes: int, process_index: int, batch_size, drop_last: bool):
    """This rank's batches, each yielded as soon as its group of num_processes batches is read: a
    loop that stops early has drawn from the sampler (its generator) as far as Accelerate's has."""
    initial, group = [], []
    for idx, batch in enumerate(batches):
        if idx < num_processes:
            initial += batch  # the epoch's first samples, to complete a short tail
        group.append(batch)
        if idx % num_processes == num_processes - 1 and (
            batch_size is None or len(batch) == batch_size
        ):
            yield group[process_index]
            group = []  # a group ending in a short batch (the last one) stays: the tail below
    if drop_last or not group:
        return
    # full batches of a last group
    tail = [b for b in group if batch_size is None or len(b) == batch_size]
    short = [b for b in group if batch_size is not None and len(b) != batch_size]
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
    yield completed[process_index]


class BatchSamplerShard(BatchSampler):
    """This rank's batches of another batch sampler (iter_shard over one epoch of it)."""

    def __init__(self, batch_sampler, num_processes: int, process_index: int):
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)
        self.num_processes, self.process_index = num_processes, process_index
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)

    def __len__(self) -> int:
        n = len(self.batch_sampler)
        return n // self.num_processes if self.drop_last else -(-n // self.num_processes)

    def __iter__(self):
        yield from iter_shard((list(b) for b in self.batch_sampler), self.num_processes,
                              self.process_index, self.batch_size, self.drop_last)


class SeedableRandomSampler(RandomSampler):
    """Accelerate's: the generator is reseeded with initial_seed + epoch at each epoch's start."""

    def __init__(self, *args, data_seed=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self):
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.epoch + self.initial_seed)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int):
        self.epoch = epoch


class GradientState:
    """What accumulate() and gather_for_metrics read: whether this micro-batch syncs, and where the
    innermost prepared loader being iterated is (its end, the real samples of its last batch)."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self.sync_gradients = True
        self.active = []                # the prepared loaders being iterated, innermost last

    @property
    def in_dataloader(self) -> bool:
        return bool(self.active)

    @property
    def end_of_dataloader(self) -> bool:
        return self.active[-1].end_of_dataloader if self.active else False

    @property
    def remainder(self) -> int:
        return self.active[-1].remainder if self.active else -1


class DataLoaderShard(DataLoader):
    """A prepared DataLoader: this rank's batches, moved to the device, the state accumulate()
    reads."""

    def __init__(self, loader: DataLoader, comm, device, state: GradientState,
                 use_seedable_sampler=False, data_seed=None):
        if isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
            raise NotImplementedError("accelerator.prepare(dataloader) of an iterable dataset or a "
                                      "loader with batch_size=None is not covered by "
                                      "minizero.accelerate: give the DataLoader a map-style "
                                      "dataset and a batch_size")
        batch_sampler = loader.batch_sampler
        sampler = loader.sampler
        if isinstance(sampler, RandomSampler) and use_seedable_sampler:
            sampler = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                            num_samples=sampler._num_samples,
                                            generator=sampler.generator, data_seed=data_seed)
        self.synchronized_generator = None
        if comm.size > 1:
            if not use_seedable_sampler and hasattr(sampler, "generator"):
                if sampler.generator is None:  # seeded from the global one (rank 0's wins below)
                    sampler.generator = torch.Generator()
                    seed = torch.empty((), dtype=torch.int64).random_().item()
                    sampler.generator.manual_seed(int(seed))
                self.synchronized_generator = sampler.generator
            batch_sampler = BatchSamplerShard(batch_sampler, comm.size, comm.rank)
        kwargs = {k: getattr(loader, k, v) for k, v in _LOADER_KWARGS.items()}
        super().__init__(loader.dataset, batch_sampler=batch_sampler, **kwargs)
        if isinstance(sampler, SeedableRandomSampler):
            self.batch_sampler.sampler = sampler
            if hasattr(self.batch_sampler, "batch_sampler"):
                self.batch_sampler.batch_sampler.sampler = sampler
        self.comm, self.device, self.state = comm, device, state
        self._drop_last = loader.drop_last
        self.iteration = 0
        self.end_of_dataloader, self.remainder = False, -1
        size = getattr(loader.batch_sampler, "batch_size", None)
        self.total_batch_size = None if size is None else size * comm.size

    def _sync_generator(self):
        if self.synchronized_generator is None:
            return
        state = self.synchronized_generator.get_state().to(self.comm.device)
        self.comm.broadcast(state, src=0)
        self.synchronized_generator.set_state(state.cpu())

    def set_epoch(self, epoch: int):
        """Accelerate's DataLoaderShard.set_epoch: the batch sampler, its sampler or the dataset."""
        self.iteration = epoch
        bs = self.batch_sampler
        if hasattr(bs, "set_epoch"):
            bs.set_epoch(epoch)
        if hasattr(getattr(bs, "sampler", None), "set_epoch"):
            bs.sampler.set_epoch(epoch)
        if hasattr(getattr(getattr(bs, "batch_sampler", None), "sampler", None), "set_epoch"):
            bs.batch_sampler.sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self):
        self._sync_generator()
        self.end_of_dataloader = False
        self.remainder = -1 if self._drop_last or not self.total_batch_size else \
            len(self.dataset) % self.total_batch_size
        self.state.active.append(self)
        try:
            self.set_epoch(self.iteration)
            it = super().__iter__()
            try:
                current = next(it)
            except StopIteration:
                return
            while True:  # one batch ahead, to know which is the last
                current = _to(current, self.device)
                try:
                    upcoming = next(it)
                except StopIteration:
                    self.end_of_dataloader = True
                    yield current
                    break
                yield current
                current = upcoming
            self.iteration += 1
        finally:
            self.state.active.remove(self)


def _to(batch, device):
    """Accelerate's send_to_device: tensors, objects with .to (a BatchEncoding), containers."""
    if torch.is_tensor(batch) or hasattr(batch, "to"):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: _to(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch
