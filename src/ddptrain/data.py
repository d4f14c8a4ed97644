"""Which samples each rank sees, and how batches reach the device.

Training uses torch's ``DistributedSampler`` (rank-strided split of one shuffled permutation
per epoch), extended to start part-way through an epoch for exact resume. Because the split
is rank-strided, the union of the ranks' t-th batches is the same slice of the epoch's
permutation for any world size with the same global batch: resuming on another number of
ranks keeps the global sample order.

Two ways to build batches give bitwise-identical tensors:
- in-memory fast path: a ``TensorDataset`` is moved to the device once and each batch is a
  single index-gather, instead of per-sample ``__getitem__`` + collate;
- any other data set goes through a ``DataLoader`` (workers, pinned memory, non-blocking copies).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

Batch = tuple[torch.Tensor, ...]


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` whose epoch can begin at this rank's ``start``-th sample."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int,
                 shuffle: bool = True) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=False)
        self.start = 0

    def set_start(self, start: int) -> None:
        """Skip this rank's first ``start`` samples of the current epoch (resume)."""
        self.start = start

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start


def steps_per_epoch(dataset_len: int, world_size: int, batch_size: int) -> int:
    """Batches each rank runs per epoch (DistributedSampler pads ranks to equal length)."""
    return math.ceil(math.ceil(dataset_len / world_size) / batch_size)


def is_in_memory(dataset: Dataset) -> bool:
    return isinstance(dataset, TensorDataset)


class TrainBatches:
    """Yields this rank's batches for one epoch, on the device, from the sampler's order."""

    def __init__(self, dataset: Dataset, sampler: ResumableDistributedSampler, batch_size: int,
                 device: torch.device, workers: int = 0, fast_path: bool | None = None) -> None:
        self.sampler, self.batch_size, self.device = sampler, batch_size, device
        self.fast_path = is_in_memory(dataset) if fast_path is None else fast_path
        if self.fast_path:
            assert isinstance(dataset, TensorDataset), "the fast path needs a TensorDataset"
            self.tensors = [t.to(device) for t in dataset.tensors]
        else:
            self.loader = DataLoader(
                dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                pin_memory=device.type == "cuda", persistent_workers=workers > 0,
            )

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        if self.fast_path:
            order = torch.tensor(list(self.sampler), dtype=torch.long, device=self.device)
            for chunk in order.split(self.batch_size):
                yield tuple(t[chunk] for t in self.tensors)
        else:
            for batch in self.loader:
                yield tuple(t.to(self.device, non_blocking=True) for t in batch)


def eval_batch_ranges(dataset_len: int, batch_size: int) -> list[range]:
    """The evaluation set cut into consecutive batches, the same cut for any world size."""
    return [range(s, min(s + batch_size, dataset_len)) for s in range(0, dataset_len, batch_size)]


def eval_shard(num_batches: int, rank: int, world_size: int) -> Sequence[int]:
    """Batch numbers this rank evaluates: disjoint, covering, no padding, no duplicates."""
    return range(rank, num_batches, world_size)
