"""Sampling and batching without a process group: DistributedSampler's contract, resumable."""

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from ddptrain.data import (
    ResumableDistributedSampler,
    TrainBatches,
    eval_batch_ranges,
    eval_shard,
    steps_per_epoch,
)

DATA = TensorDataset(torch.arange(50, dtype=torch.float32).unsqueeze(1), torch.arange(50))


def order(world, rank, epoch, seed=0):
    sampler = ResumableDistributedSampler(DATA, world, rank, seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_same_order_as_torch_distributed_sampler():
    for rank in (0, 1):
        torch_sampler = DistributedSampler(DATA, num_replicas=2, rank=rank, seed=7)
        torch_sampler.set_epoch(3)
        assert order(2, rank, 3, seed=7) == list(torch_sampler)


def test_start_skips_exactly_the_consumed_samples():
    sampler = ResumableDistributedSampler(DATA, 2, 1, 0)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_start(10)
    assert list(sampler) == full[10:] and len(sampler) == len(full) - 10


def test_global_batch_is_the_same_slice_for_any_world_size():
    """Union of the ranks' t-th batches: same samples for 1, 2 or 4 ranks at global batch 8."""
    data = TensorDataset(torch.zeros(64, 1))
    def batches(world, epoch):
        per_rank = [ResumableDistributedSampler(data, world, r, 0) for r in range(world)]
        for s in per_rank:
            s.set_epoch(epoch)
        orders = [list(s) for s in per_rank]
        b = 8 // world
        return [sorted(sum((o[t * b:(t + 1) * b] for o in orders), [])) for t in range(8)]

    for epoch in (0, 1):
        assert batches(1, epoch) == batches(2, epoch) == batches(4, epoch)


def test_fast_path_and_dataloader_give_identical_batches():
    sampler = ResumableDistributedSampler(DATA, 2, 0, 0)
    sampler.set_epoch(1)
    fast = list(TrainBatches(DATA, sampler, 4, torch.device("cpu"), fast_path=True))
    slow = list(TrainBatches(DATA, sampler, 4, torch.device("cpu"), fast_path=False))
    assert len(fast) == len(slow) == steps_per_epoch(50, 2, 4) == 7
    for a, b in zip(fast, slow):
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))


def test_eval_shards_are_disjoint_unpadded_and_cover():
    ranges = eval_batch_ranges(23, 5)
    assert [len(r) for r in ranges] == [5, 5, 5, 5, 3]
    for world in (1, 2, 3, 7):
        shards = [list(eval_shard(len(ranges), r, world)) for r in range(world)]
        assert sorted(sum(shards, [])) == list(range(len(ranges)))
