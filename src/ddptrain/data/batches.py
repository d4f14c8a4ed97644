"""How batches reach the device, for training (``TrainBatches``: a map-style set's planned
micro-batches, grouped into optimizer steps) and for evaluation (``EvalBatches``).

Evaluation cuts the set into the same consecutive batches for any world size; rank r takes
batches r, r+W, ... (no padding, no duplicates), so its figures can be exact (observe/evaluation.py).

Two ways to build batches give bitwise-identical tensors, in training and in evaluation:
- in-memory fast path: a ``TensorDataset`` (and no ``collate_fn``) is moved to the device
  once and each batch is a single index-gather, instead of per-sample ``__getitem__``;
- any other data set goes through a ``DataLoader`` (``--workers``, the task's
  ``collate_fn``, pinned memory and non-blocking copies on CUDA).

A batch may be a tensor, a tuple or list, a dict, or these nested: every tensor in it is
moved to the device; other leaves (strings, numbers) pass through unchanged.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, TensorDataset, default_collate

from .sampling import MicroBatch, StepSampler
from .workers import settle_before_fork


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor moved to ``device`` (tuples, lists, dicts followed)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device, non_blocking) for k, v in batch.items()}
        try:
            return moved if type(batch) is dict else type(batch)(moved)  # type: ignore[call-arg]  # a Mapping subclass built from a dict
        except TypeError:  # a mapping type that cannot be built from a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


class ExplainedCollate:
    """The batch's collate function (the task's, or torch's default), whose failure names two
    samples of the batch that do not fit together (their shapes, dtypes or keys): torch's own
    message ("stack expects each tensor to be equal size") names neither. A class, not a
    closure: DataLoader workers started by spawn receive it pickled."""

    def __init__(self, collate_fn: Callable[..., Any] | None) -> None:
        self.collate_fn = collate_fn or default_collate

    def __call__(self, samples: list[Any]) -> Any:
        try:
            return self.collate_fn(samples)
        except Exception as error:
            mismatch = first_mismatch(samples)
            if mismatch is None:
                raise
            index, first, other = mismatch
            reason = " ".join(str(error).split())[:200]
            raise ValueError(f"the batch's samples do not fit together: sample 0 of the batch is {first}, sample "
                             f"{index} is {other} ({type(error).__name__}: {reason})") from error


def first_mismatch(samples: list[Any]) -> tuple[int, str, str] | None:
    """(index, sample 0's layout, that sample's layout) for the first sample laid out otherwise."""
    if not samples:
        return None
    first = layout(samples[0])
    for index, sample in enumerate(samples[1:], start=1):
        other = layout(sample)
        if other != first:
            return index, first, other
    return None


def layout(sample: Any) -> str:
    """A sample's structure: tensors' shapes and dtypes, dicts' keys, sequences' lengths."""
    if isinstance(sample, torch.Tensor) or hasattr(sample, "shape") and hasattr(sample, "dtype"):
        return f"{type(sample).__name__}{list(sample.shape)} {str(sample.dtype).removeprefix('torch.')}"
    if isinstance(sample, dict):
        return "{" + ", ".join(f"{key!r}: {layout(value)}" for key, value in sample.items()) + "}"
    if isinstance(sample, (list, tuple)):
        inner = ", ".join(layout(value) for value in sample)
        return f"({inner})" if isinstance(sample, tuple) else f"[{inner}]"
    return type(sample).__name__


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
        return DataLoader(self.dataset, num_workers=self.workers, collate_fn=ExplainedCollate(self.collate_fn),
                          pin_memory=self.device.type == "cuda", generator=self.generator, **kwargs)

    def _moved(self, loader: DataLoader) -> Iterator[Any]:
        non_blocking = self.device.type == "cuda"
        if self.workers:
            settle_before_fork()  # the epoch's iterator may fork its workers
        for batch in loader:
            yield to_device(batch, self.device, non_blocking)


class _PlannedBatches(Sampler[list[int]]):
    """A batch sampler: the index lists of the epoch's planned micro-batches."""

    def __init__(self, owner: TrainBatches) -> None:
        self.owner = owner

    def __iter__(self) -> Iterator[list[int]]:
        return (micro.indices.tolist() for micro in self.owner.plan())  # type: ignore[union-attr]  # planned micro-batches have indices

    def __len__(self) -> int:
        return self.owner.micro_batch_count()


class TrainBatches(_Batches):
    """This rank's optimizer steps of one epoch of a map-style set: each a list of ``grad_accum``
    ``(batch, MicroBatch)`` pairs, the batches on the device."""

    def __init__(self, dataset: Dataset, sampler: StepSampler, device: torch.device, workers: int = 0,
                 collate_fn: Callable[..., Any] | None = None, fast_path: bool | None = None) -> None:
        super().__init__(dataset, device, workers, collate_fn, fast_path)
        self.sampler = sampler
        self.order, self.start_step = torch.arange(0), 0
        self.order_on_device = self.order
        if not self.fast_path:
            # A data set with set_epoch needs fresh workers each epoch to see the new epoch.
            persistent = workers > 0 and not hasattr(dataset, "set_epoch")
            self.loader = self._loader(batch_sampler=_PlannedBatches(self), persistent_workers=persistent)

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps

    @property
    def epoch_samples(self) -> int:
        return self.sampler.dataset_len

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Shuffle for ``epoch`` and begin at optimizer step ``start_step`` (resume); a data set
        with its own ``set_epoch`` (epoch-dependent augmentation) hears it too."""
        self.sampler.set_epoch(epoch)
        self.order, self.start_step = self.sampler.order(), start_step
        # One copy an epoch: a copy from pageable memory waits for the GPU to finish what is queued
        # (CUDA's rule), so a copy of each step's indices stopped the host at every step.
        self.order_on_device = self.order.to(self.device) if self.fast_path else self.order
        self.generator.manual_seed(self.sampler.seed * 1_000_003 + epoch)  # workers' seeds: (seed, epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def plan(self) -> Iterator[MicroBatch]:
        return self.sampler.micro_batches(self.order, self.start_step)

    def micro_batch_count(self) -> int:
        return (self.sampler.steps - self.start_step) * self.sampler.grad_accum

    def agreed_samples(self) -> None:
        """(A stream's steps are counted after the fact; here each MicroBatch knows its step's.)"""
        return None

    def steps(self) -> Iterator[list[tuple[Any, MicroBatch]]]:
        """The epoch's remaining optimizer steps, ``grad_accum`` micro-batches each."""
        if self.fast_path:  # indices sliced from the epoch's order on the device: no host sync a step
            pairs: Iterator[tuple[Any, MicroBatch]] = (
                (tuple(t[micro.indices] for t in self.tensors), micro)
                for micro in self.sampler.micro_batches(self.order_on_device, self.start_step))
        else:
            pairs = zip(self._moved(self.loader), self.plan())
        while group := list(itertools.islice(pairs, self.sampler.grad_accum)):
            yield group


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


def eval_subset(dataset: Dataset, samples: int, seed: int) -> Dataset:
    """--eval-batches: ``samples`` of the evaluation set drawn once from ``seed`` (in the set's
    order), the same whatever the world size, so figures compare across the run and across jobs;
    a TensorDataset stays one (the fast path)."""
    size = len(dataset)  # type: ignore[arg-type]  # map-style: checked by check_task
    if samples >= size:
        return dataset
    chosen = torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:samples].sort().values
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(tensor[chosen] for tensor in dataset.tensors))
    return Subset(dataset, chosen.tolist())


class EvalBatches(_Batches):
    """Yields ``(batch number, batch)`` for this rank's share of the evaluation set.

    ``equal_counts``: every rank yields as many batches as the rank with the most (sharded
    models all-gather in every forward, so every rank must run the same number); the extra
    ones repeat batch 0 with the number -1, and their figures are not counted."""

    def __init__(self, dataset: Dataset, batch_size: int, rank: int, world_size: int, device: torch.device,
                 workers: int = 0, collate_fn: Callable[..., Any] | None = None,
                 fast_path: bool | None = None, equal_counts: bool = False) -> None:
        super().__init__(dataset, device, workers, collate_fn, fast_path)
        self.ranges = eval_batch_ranges(len(dataset), batch_size)  # type: ignore[arg-type]  # map-style: it has a length
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
