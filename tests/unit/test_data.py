"""Sampling and batching without a process group: exact steps on any data-set size, resumable."""

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from ddptrain.data import EvalBatches, StepSampler, TrainBatches, to_device
from ddptrain.data.batches import eval_batch_ranges, eval_shard

DATA = TensorDataset(torch.arange(50, dtype=torch.float32).unsqueeze(1), torch.arange(50))


def plan(n, world, rank, batch, accum=1, epoch=0, seed=0, start=0):
    sampler = StepSampler(n, world, rank, batch, accum, seed)
    sampler.set_epoch(epoch)
    return list(sampler.micro_batches(sampler.order(), start))


def steps(n, world, batch, accum=1, epoch=0):
    """Per optimizer step: the sorted samples of every rank's micro-batches, and the counts."""
    plans = [plan(n, world, r, batch, accum, epoch) for r in range(world)]
    result = []
    for t in range(len(plans[0]) // accum):
        micro = [m for p in plans for m in p[t * accum:(t + 1) * accum]]
        real = sorted(i for m in micro if m.samples for i in m.indices.tolist())
        result.append((real, {m.step_samples for m in micro}))
    return result


def test_full_steps_are_torch_distributed_samplers_order():
    """Where the data divides evenly, each rank trains what DistributedSampler gives it."""
    for rank in (0, 1):
        torch_sampler = DistributedSampler(range(48), num_replicas=2, rank=rank, seed=7)
        torch_sampler.set_epoch(3)
        mine = torch.cat([m.indices for m in plan(48, 2, rank, 4, epoch=3, seed=7)]).tolist()
        assert mine == list(torch_sampler)


@pytest.mark.parametrize("n", [600, 601, 5, 33, 64])
@pytest.mark.parametrize("world, batch, accum", [(1, 32, 1), (2, 16, 1), (2, 8, 2), (1, 16, 2), (3, 4, 3), (4, 8, 1)])
def test_every_sample_trains_exactly_once_per_epoch_and_counts_are_exact(n, world, batch, accum):
    """No padding, no duplicates, on any size; a step's count is what is really in it; every
    rank runs the same number of micro-batches (stand-ins, weight 0, where it has nothing)."""
    plans = [plan(n, world, r, batch, accum, epoch=1) for r in range(world)]
    assert len({len(p) for p in plans}) == 1 and len(plans[0]) % accum == 0
    trained = sorted(i for p in plans for m in p if m.samples for i in m.indices.tolist())
    assert trained == list(range(n))
    for real, counts in steps(n, world, batch, accum, epoch=1):
        assert counts == {len(real)}
    for p in plans:
        for m in p:
            assert m.samples == (len(m.indices) if m.samples else 0) and len(m.indices) <= batch
    weights = sum(m.weight for p in plans for m in p[-accum:])
    assert weights == pytest.approx(world)  # the ranks' weighted means average to the step's mean


@pytest.mark.parametrize("n", [600, 601])
def test_a_step_holds_the_same_samples_for_any_world_size_and_accumulation(n):
    """Global batch 32 as 1 x 32, 2 x 16, 2 x 8 x 2, 1 x 16 x 2, 4 x 8: the same steps."""
    reference = steps(n, 1, 32)
    for world, batch, accum in [(2, 16, 1), (2, 8, 2), (1, 16, 2), (4, 8, 1), (4, 4, 2)]:
        assert steps(n, world, batch, accum) == reference
    assert len(reference) == -(-n // 32)


def test_a_rank_with_nothing_in_the_last_step_gets_a_weightless_stand_in():
    """5 samples, 4 ranks x 2 x accumulation 2: the short step has micro-batches of 3 and 2."""
    for rank in range(4):
        last = plan(5, 4, rank, 2, 2)[-2:]
        for micro, size in zip(last, (3, 2)):
            assert micro.step_samples == 5
            assert micro.samples == (1 if rank < size else 0)
            assert len(micro.indices) == 1
        if rank >= 3:
            assert all(m.weight == 0 for m in last)


def test_start_skips_exactly_the_consumed_steps():
    full = plan(601, 2, 1, 8, 2, epoch=2)
    for start in (0, 5, 37, 38):
        assert [m.indices.tolist() for m in plan(601, 2, 1, 8, 2, epoch=2, start=start)] == \
            [m.indices.tolist() for m in full[start * 2:]]


def test_fast_path_and_dataloader_give_identical_batches():
    sampler = StepSampler(50, 2, 0, 4, 1, 0)
    fast_batches = TrainBatches(DATA, sampler, torch.device("cpu"), fast_path=True)
    slow_batches = TrainBatches(DATA, sampler, torch.device("cpu"), fast_path=False)
    fast_batches.set_epoch(1)
    slow_batches.set_epoch(1)
    fast, slow = ([pair for step in batches.steps() for pair in step] for batches in (fast_batches, slow_batches))
    fast, slow = list(fast), list(slow)
    assert len(fast) == len(slow) == sampler.steps == 7
    for (a, micro_a), (b, micro_b) in zip(fast, slow):
        assert torch.equal(micro_a.indices, micro_b.indices) and micro_a.samples == micro_b.samples
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
    batches = TrainBatches(data, StepSampler(len(data), 1, 0, 4), torch.device("cpu"), workers=2)
    for epoch in (3, 4):
        batches.set_epoch(epoch)
        assert {int(e) for step in batches.steps() for batch, _ in step for e in batch[:, 1]} == {epoch}


def test_samples_that_do_not_fit_together_are_named_by_their_shapes_and_keys():
    from ddptrain.data.batches import ExplainedCollate

    collate = ExplainedCollate(None)
    assert collate([torch.zeros(3), torch.ones(3)]).shape == (2, 3)  # torch's default, untouched
    with pytest.raises(ValueError, match=r"sample 0 of the batch is \(Tensor\[20\] float32, Tensor\[\] int64\), "
                                         r"sample 2 is \(Tensor\[21\] float32, Tensor\[\] int64\) \(RuntimeError: "):
        collate([(torch.zeros(20), torch.tensor(1)), (torch.zeros(20), torch.tensor(1)),
                 (torch.zeros(21), torch.tensor(1))])
    with pytest.raises(ValueError, match=r"sample 0 of the batch is \{'x': Tensor\[2\] float32\}, sample 1 is "
                                         r"\{'y': Tensor\[2\] float32\}"):
        collate([{"x": torch.zeros(2)}, {"y": torch.zeros(2)}])
