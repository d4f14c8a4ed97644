"""Which samples each rank trains on at each optimizer step of a map-style data set.

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
backward every rank runs, so collectives stay matched and nothing hangs. The epoch's
micro-batches are made as they are needed (a set of millions of samples costs its
permutation, not a list of millions of objects).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of this rank: which samples, and its share of the optimizer step."""

    indices: torch.Tensor | None  # this rank's samples (a stand-in when it has none; None: from a stream)
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

    def micro_batches(self, order: torch.Tensor, start_step: int = 0) -> Iterator[MicroBatch]:
        """This rank's micro-batches of the epoch whose permutation is ``order``, from optimizer
        step ``start_step`` on: ``grad_accum`` of them per step, on every rank, made as needed."""
        world, rank = self.world_size, self.rank
        full_steps = self.dataset_len // self.global_batch
        if start_step < full_steps:  # one view: [micro-batch, position, rank]
            full = order[start_step * self.global_batch:full_steps * self.global_batch]
            rows = full.view(-1, self.batch_size, world)[:, :, rank]
            for i in range(len(rows)):  # one row at a time (iterating a tensor unbinds it whole)
                yield MicroBatch(rows[i], self.batch_size, self.global_batch, world)
        if full_steps < self.steps and start_step <= full_steps:
            yield from self._short_step(order[full_steps * self.global_batch:])

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
