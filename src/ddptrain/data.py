"""Which samples each rank sees, and how batches reach the device.

Training is exact on any data-set size: ``StepSampler`` shuffles the set once per epoch (the
permutation torch's ``DistributedSampler`` draws: ``randperm`` seeded with seed + epoch) and
optimizer step t trains on the permutation's slice ``[t*G, (t+1)*G)`` (G: the global batch,
ranks x batch x accumulation), the last step on what is left. Every sample trains exactly once
per epoch: no padding (DistributedSampler repeats samples to even out the ranks, pytorch
issue 25162) and nothing dropped. A step's slice is cut into ``grad_accum`` consecutive
micro-chunks as evenly as possible and rank r takes positions r, r+W, ... of each, so full
steps are rank-strided exactly as DistributedSampler's, and the same global batch gives the
same steps on any world size (resuming on another number of ranks keeps the sample order).

Each micro-batch carries its sample counts (``MicroBatch``), known on every rank without
communication: the Trainer weighs its loss by its share of the step, so a step's gradient is
the mean over the samples really in it. A rank with no sample in a micro-batch (only in a
short last step) gets one stand-in sample with weight 0: it still runs the forward and
backward every rank runs, so collectives stay matched and nothing hangs.

Evaluation cuts the set into the same consecutive batches for any world size; rank r takes
batches r, r+W, ... (no padding, no duplicates), so its figures can be exact (observe/metrics.py).

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
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset, default_collate


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


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of this rank: which samples, and its share of the optimizer step."""

    indices: torch.Tensor  # this rank's samples (one stand-in sample when it has none)
    samples: int  # this rank's real samples in it (0: a stand-in, weight 0)
    step_samples: int  # samples in the whole optimizer step, over every rank and micro-batch
    world_size: int

    @property
    def weight(self) -> float:
        """What this micro-batch's mean loss is multiplied by so that the ranks' gradients,
        averaged by DDP/FSDP over the world size, are the mean over the step's samples."""
        return self.samples * self.world_size / self.step_samples


class StepSampler:
    """This rank's samples at every optimizer step of an epoch (see the module docstring)."""

    def __init__(self, dataset_len: int, world_size: int, rank: int, batch_size: int, grad_accum: int = 1,
                 seed: int = 0, shuffle: bool = True) -> None:
        self.dataset_len, self.world_size, self.rank = dataset_len, world_size, rank
        self.batch_size, self.grad_accum, self.seed, self.shuffle = batch_size, grad_accum, seed, shuffle
        self.global_batch = world_size * batch_size * grad_accum
        self.epoch = 0

    @property
    def steps(self) -> int:
        """Optimizer steps per epoch (the last may be short)."""
        return -(-self.dataset_len // self.global_batch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        """The epoch's permutation (DistributedSampler's, for the same seed and epoch)."""
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=generator)

    def micro_batches(self, start_step: int = 0) -> list[MicroBatch]:
        """This rank's micro-batches of the epoch from optimizer step ``start_step`` on:
        ``grad_accum`` of them per step, on every rank."""
        order, world, rank = self.order(), self.world_size, self.rank
        full_steps = self.dataset_len // self.global_batch
        result = []
        if start_step < full_steps:  # one view: [micro-batch, position, rank]
            full = order[start_step * self.global_batch:full_steps * self.global_batch]
            rows = full.view(-1, self.batch_size, world)[:, :, rank]
            result = [MicroBatch(row, self.batch_size, self.global_batch, world) for row in rows]
        if full_steps < self.steps and start_step <= full_steps:
            result += self._short_step(order[full_steps * self.global_batch:])
        return result

    def _short_step(self, rest: torch.Tensor) -> list[MicroBatch]:
        """The last step's micro-batches: ``rest`` cut into grad_accum chunks as even as can be."""
        total, parts = len(rest), self.grad_accum
        sizes = [total // parts + (1 if k < total % parts else 0) for k in range(parts)]
        batches, offset = [], 0
        for size in sizes:
            mine = rest[offset:offset + size][self.rank::self.world_size]
            offset += size
            if len(mine):
                batches.append(MicroBatch(mine, len(mine), total, self.world_size))
            else:  # nothing for this rank: a stand-in (the step's first sample) with weight 0
                batches.append(MicroBatch(rest[:1], 0, total, self.world_size))
        return batches


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


class _PlannedBatches(Sampler[list[int]]):
    """A batch sampler: the index lists of the epoch's planned micro-batches."""

    def __init__(self, owner: TrainBatches) -> None:
        self.owner = owner

    def __iter__(self) -> Iterator[list[int]]:
        return (micro.indices.tolist() for micro in self.owner.plan)

    def __len__(self) -> int:
        return len(self.owner.plan)


class TrainBatches(_Batches):
    """Yields ``(batch, MicroBatch)`` for this rank's micro-batches of one epoch, on the device."""

    def __init__(self, dataset: Dataset, sampler: StepSampler, device: torch.device, workers: int = 0,
                 collate_fn: Callable[..., Any] | None = None, fast_path: bool | None = None) -> None:
        super().__init__(dataset, device, workers, collate_fn, fast_path)
        self.sampler = sampler
        self.plan: list[MicroBatch] = []
        if not self.fast_path:
            # A data set with set_epoch needs fresh workers each epoch to see the new epoch.
            persistent = workers > 0 and not hasattr(dataset, "set_epoch")
            self.loader = self._loader(batch_sampler=_PlannedBatches(self), persistent_workers=persistent)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Shuffle for ``epoch`` and begin at optimizer step ``start_step`` (resume); a data set
        with its own ``set_epoch`` (epoch-dependent augmentation) hears it too."""
        self.sampler.set_epoch(epoch)
        self.plan = self.sampler.micro_batches(start_step)
        self.generator.manual_seed(self.sampler.seed * 1_000_003 + epoch)  # workers' seeds: (seed, epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[tuple[Any, MicroBatch]]:
        if self.fast_path:
            indices = (micro.indices.to(self.device) for micro in self.plan)
            return zip(self._gather(indices), self.plan)
        return zip(self._moved(self.loader), self.plan)


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
