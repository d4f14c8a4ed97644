"""Which samples each rank sees, and how batches reach the device.

Training uses torch's ``DistributedSampler`` (rank-strided split of one shuffled permutation
per epoch), extended to start part-way through an epoch for exact resume. Because the split
is rank-strided, the union of the ranks' t-th batches is the same slice of the epoch's
permutation for any world size with the same global batch: resuming on another number of
ranks keeps the global sample order.

Evaluation cuts the set into the same consecutive batches for any world size; rank r takes
batches r, r+W, ... (no padding, no duplicates), so its figures can be exact (metrics.py).

Two ways to build batches give bitwise-identical tensors, in training and in evaluation:
- in-memory fast path: a ``TensorDataset`` (and no ``collate_fn``) is moved to the device
  once and each batch is a single index-gather, instead of per-sample ``__getitem__``;
- any other data set goes through a ``DataLoader`` (``--workers``, the task's
  ``collate_fn``, pinned memory and non-blocking copies on CUDA).

A batch may be a tensor, a tuple or list, a dict, or these nested: every tensor in it is
moved to the device; other leaves (strings, numbers) pass through unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset, default_collate


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor moved to ``device`` (tuples, lists, dicts followed)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device, non_blocking) for k, v in batch.items()}
        try:
            return moved if type(batch) is dict else type(batch)(moved)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


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


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        size = batch_size_of(value)
        if size:
            return size
    return 0


def steps_per_epoch(dataset_len: int, world_size: int, batch_size: int) -> int:
    """Batches each rank runs per epoch (DistributedSampler pads ranks to equal length)."""
    return math.ceil(math.ceil(dataset_len / world_size) / batch_size)


def uses_fast_path(dataset: Dataset, collate_fn: Callable[..., Any] | None) -> bool:
    return isinstance(dataset, TensorDataset) and collate_fn is None


class _Batches:
    """Index lists -> batches on the device, by the fast path or a DataLoader."""

    def __init__(self, dataset: Dataset, device: torch.device, workers: int,
                 collate_fn: Callable[..., Any] | None, fast_path: bool | None) -> None:
        self.device = device
        self.fast_path = uses_fast_path(dataset, collate_fn) if fast_path is None else fast_path
        self.dataset, self.workers, self.collate_fn = dataset, workers, collate_fn
        # Each DataLoader iterator draws a seed for its workers. From the global generator, that
        # draw would shift the model's own random stream (dropout) in a resumed run, which
        # starts one more iterator than the run it continues: the loaders have their own.
        self.generator = torch.Generator()
        if self.fast_path:
            assert isinstance(dataset, TensorDataset), "the fast path needs a TensorDataset"
            self.tensors = [t.to(device) for t in dataset.tensors]

    def _gather(self, chunks: Iterator[torch.Tensor]) -> Iterator[tuple[torch.Tensor, ...]]:
        for chunk in chunks:
            yield tuple(t[chunk] for t in self.tensors)

    def _loader(self, **kwargs: Any) -> DataLoader:
        return DataLoader(self.dataset, num_workers=self.workers, collate_fn=self.collate_fn,
                          pin_memory=self.device.type == "cuda", generator=self.generator, **kwargs)

    def _moved(self, loader: DataLoader) -> Iterator[Any]:
        non_blocking = self.device.type == "cuda"
        for batch in loader:
            yield to_device(batch, self.device, non_blocking)


class TrainBatches(_Batches):
    """Yields this rank's batches for one epoch, on the device, in the sampler's order."""

    def __init__(self, dataset: Dataset, sampler: ResumableDistributedSampler, batch_size: int,
                 device: torch.device, workers: int = 0, collate_fn: Callable[..., Any] | None = None,
                 fast_path: bool | None = None) -> None:
        super().__init__(dataset, device, workers, collate_fn, fast_path)
        self.sampler, self.batch_size = sampler, batch_size
        if not self.fast_path:
            # A data set with set_epoch needs fresh workers each epoch to see the new epoch.
            persistent = workers > 0 and not hasattr(dataset, "set_epoch")
            self.loader = self._loader(batch_size=batch_size, sampler=sampler, persistent_workers=persistent)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Shuffle for ``epoch`` (DistributedSampler's set_epoch) from this rank's ``start``-th
        sample; a data set with its own ``set_epoch`` (epoch-dependent augmentation) hears it too."""
        self.sampler.set_epoch(epoch)
        self.sampler.set_start(start)
        self.generator.manual_seed(self.sampler.seed * 1_000_003 + epoch)  # workers' seeds: (seed, epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        if self.fast_path:
            order = torch.tensor(list(self.sampler), dtype=torch.long, device=self.device)
            return self._gather(iter(order.split(self.batch_size)))
        return self._moved(self.loader)


def eval_batch_ranges(dataset_len: int, batch_size: int) -> list[range]:
    """The evaluation set cut into consecutive batches, the same cut for any world size."""
    return [range(s, min(s + batch_size, dataset_len)) for s in range(0, dataset_len, batch_size)]


def eval_shard(num_batches: int, rank: int, world_size: int) -> Sequence[int]:
    """Batch numbers this rank evaluates: disjoint, covering, no padding, no duplicates."""
    return range(rank, num_batches, world_size)


class _ShardBatches(Sampler[list[int]]):
    """A batch sampler: the index lists of this rank's evaluation batches."""

    def __init__(self, ranges: list[range], shard: Sequence[int]) -> None:
        self.ranges, self.shard = ranges, shard

    def __iter__(self) -> Iterator[list[int]]:
        return (list(self.ranges[b]) for b in self.shard)

    def __len__(self) -> int:
        return len(self.shard)


class EvalBatches(_Batches):
    """Yields ``(batch number, batch)`` for this rank's share of the evaluation set.

    ``equal_counts``: every rank yields as many batches as the rank with the most (sharded
    models all-gather in every forward, so every rank must run the same number); the extra
    ones repeat batch 0 with the number -1, and their figures are not counted."""

    def __init__(self, dataset: Dataset, batch_size: int, rank: int, world_size: int, device: torch.device,
                 workers: int = 0, collate_fn: Callable[..., Any] | None = None,
                 fast_path: bool | None = None, equal_counts: bool = False) -> None:
        super().__init__(dataset, device, workers, collate_fn, fast_path)
        self.ranges = eval_batch_ranges(len(dataset), batch_size)  # type: ignore[arg-type]
        self.shard = eval_shard(len(self.ranges), rank, world_size)
        most = math.ceil(len(self.ranges) / world_size)
        self.padding = most - len(self.shard) if equal_counts else 0
        if not self.fast_path:
            # Workers live for the whole run: started once, not at every evaluation.
            self.loader = self._loader(batch_sampler=_ShardBatches(self.ranges, self.shard),
                                       persistent_workers=workers > 0)

    @property
    def num_batches(self) -> int:
        return len(self.ranges)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if self.fast_path:
            chunks = (torch.arange(self.ranges[b].start, self.ranges[b].stop, device=self.device) for b in self.shard)
            yield from zip(self.shard, self._gather(chunks))
        else:
            yield from zip(self.shard, self._moved(self.loader))
        for _ in range(self.padding):
            yield -1, self._first_batch()

    def _first_batch(self) -> Any:
        samples = [self.dataset[i] for i in self.ranges[0]]
        return to_device((self.collate_fn or default_collate)(samples), self.device)
