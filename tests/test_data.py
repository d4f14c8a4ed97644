"""Sampling and batching without a process group: DistributedSampler's contract, resumable."""

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from ddptrain.data import (
    EvalBatches,
    ResumableDistributedSampler,
    TrainBatches,
    batch_size_of,
    eval_batch_ranges,
    eval_shard,
    steps_per_epoch,
    to_device,
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


def test_batches_of_any_structure_reach_the_device_with_other_leaves_untouched():
    from collections import namedtuple

    Pair = namedtuple("Pair", "x y")
    batch = {"ids": torch.ones(2, 3), "meta": ["a", "b"], "nested": (torch.zeros(2), 7, Pair(torch.ones(1), "s"))}
    moved = to_device(batch, torch.device("cpu"))
    assert moved.keys() == batch.keys() and moved["meta"] == ["a", "b"]
    assert torch.equal(moved["ids"], batch["ids"]) and moved["nested"][1] == 7
    assert isinstance(moved["nested"][2], Pair) and moved["nested"][2].y == "s"


def test_a_batch_counts_the_samples_of_its_first_tensor_at_any_depth():
    assert batch_size_of({"meta": ["a", "b"], "ids": (torch.ones(3, 5), torch.ones(7))}) == 3
    assert batch_size_of((torch.tensor(2.0), "x")) == 1
    assert batch_size_of(["a", "b"]) == 0


def _dict_collate(samples):
    return {"x": torch.stack([s[0] for s in samples]), "y": torch.stack([s[1] for s in samples])}


def test_eval_batches_are_the_same_through_the_fast_path_and_dataloader_workers():
    """The evaluation shard of rank 1 of 3, batch 4: by index-gather, and by a DataLoader with 0 and 2 workers."""
    fast = list(EvalBatches(DATA, 4, 1, 3, torch.device("cpu"), fast_path=True))
    for workers in (0, 2):
        slow = list(EvalBatches(DATA, 4, 1, 3, torch.device("cpu"), workers=workers, fast_path=False))
        assert [n for n, _ in slow] == [n for n, _ in fast] == list(range(1, 13, 3))
        for (_, a), (_, b) in zip(fast, slow):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    with_collate = list(EvalBatches(DATA, 4, 1, 3, torch.device("cpu"), collate_fn=_dict_collate))
    assert torch.equal(with_collate[0][1]["x"], fast[0][1][0])


def test_sharded_models_get_equal_batch_counts_with_uncounted_padding():
    counts = [len(list(EvalBatches(DATA, 4, r, 3, torch.device("cpu"), equal_counts=True))) for r in range(3)]
    assert counts == [5, 5, 5]  # 13 batches: 5, 4, 4 real ones
    padding = [n for n, _ in EvalBatches(DATA, 4, 2, 3, torch.device("cpu"), equal_counts=True)][-1]
    assert padding == -1


class _Epochs(torch.utils.data.Dataset):
    def __init__(self):
        self.epoch = None

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.tensor([index, self.epoch])


def test_a_data_set_with_set_epoch_hears_each_epoch_even_in_workers():
    data = _Epochs()
    sampler = ResumableDistributedSampler(data, 1, 0, 0)
    batches = TrainBatches(data, sampler, 4, torch.device("cpu"), workers=2)
    for epoch in (3, 4):
        batches.set_epoch(epoch)
        assert {int(e) for batch in batches for e in batch[:, 1]} == {epoch}
