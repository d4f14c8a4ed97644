"""Components that own their state: what goes into a snapshot comes back out the same."""

import math

import pytest
import torch

from ddptrain.observe.metrics import EpochLosses
from ddptrain.progress import Progress
from ddptrain.resilience.guard import NonFiniteGuard
from ddptrain.snapshots.checkpointer import OneTable


def test_progress_round_trips_through_its_state():
    saved = Progress(epoch=3, step_in_epoch=7, global_step=52).state_dict()
    restored = Progress()
    restored.load_state_dict(saved)
    assert restored == Progress(3, 7, 52)

def test_a_snapshot_at_an_epochs_last_step_resumes_at_its_end():
    progress = Progress(steps_per_epoch=5)  # a 0.2 snapshot may have stopped past the epoch's steps
    progress.load_state_dict({"epoch": 1, "step_in_epoch": 9, "global_step": 14})
    assert (progress.epoch, progress.step_in_epoch) == (1, 5)

def test_one_table_holds_several_components_states():
    guard = NonFiniteGuard(skip_limit=3)
    guard.skip(4)
    table = OneTable(Progress(2, 3, 23), guard)
    assert table.state_dict() == {"epoch": 2, "step_in_epoch": 3, "global_step": 23, "epoch_samples": 0,
                                  "skipped_steps": [4]}
    progress, restored = Progress(), NonFiniteGuard(skip_limit=3)
    OneTable(progress, restored).load_state_dict(table.state_dict())
    assert progress == Progress(2, 3, 23) and restored.skipped == [4]

def test_the_guard_keeps_its_skipped_steps_across_a_resume():
    guard = NonFiniteGuard(skip_limit=3)
    guard.skip(4)
    guard.skip(13)
    restored = NonFiniteGuard(skip_limit=3)
    restored.load_state_dict(guard.state_dict())
    assert restored.skipped == [4, 13] and restored.skipped_after(10) == [13]  # epoch 1's, 10 steps each
    restored.load_state_dict({})  # a snapshot without skips
    assert restored.skipped == []

def test_the_epochs_loss_so_far_is_carried_by_one_rank_only():
    losses = EpochLosses(torch.device("cpu"), capacity=8)
    for value in (2.0, 4.0):
        losses.add(torch.tensor(value))
    losses.note_reduced(total=12.0, steps=4)  # what every rank's sums added up to
    state = losses.state_dict()
    assert state == {"epoch_loss_total": 12.0, "epoch_loss_steps": 4}
    main = EpochLosses(torch.device("cpu"), 8, carries=True)
    other = EpochLosses(torch.device("cpu"), 8, carries=False)
    table = OneTable(Progress(global_step=20), main)  # the snapshot's progress table
    main.load_state_dict(table.state_dict() | state)
    other.load_state_dict(table.state_dict() | state)
    main.add(torch.tensor(1.0))
    assert float(main.local_sum()) == 13.0 and main.local_steps() == 5
    assert float(other.local_sum()) == 0.0 and other.local_steps() == 0
    main.add(torch.tensor(math.nan))
    assert float(main.first_nonfinite_step()) == 22  # the second loss after step 20

def test_a_resume_keeps_the_records_before_its_snapshot_and_logs_its_epochs_end_again():
    from ddptrain.observe.report import kept_on_resume

    records = [{"kind": "epoch", "epoch": 0, "step": 30}, {"kind": "eval", "epoch": 1, "step": 45},
               {"kind": "epoch", "epoch": 1, "step": 45}, {"kind": "epoch", "epoch": 2, "step": 50, "partial": True}]
    # a stream's snapshot at its epoch's last step (45), taken before the stream said it was over
    assert [kept_on_resume(r, 45, 1) for r in records] == [True, True, False, False]
    # the snapshot at epoch 1's end, after its record: epoch 2 starts
    assert [kept_on_resume(r, 45, 2) for r in records] == [True, True, True, False]
    assert [kept_on_resume(r, 40, 1) for r in records] == [True, False, False, False]  # inside epoch 1

def test_grad_norms_are_the_mean_and_largest_over_the_epoch_and_a_resume_adds_up_the_same():
    from ddptrain.comm import local_tensors, no_tensors
    from ddptrain.observe.metrics import GradNorms

    steps = [[torch.tensor([3.0, 4.0])], [torch.tensor([0.0, 1.0]), torch.tensor([[2.0, 2.0]])],
             [torch.tensor([float("inf")])], [torch.tensor([6.0, 8.0])]]  # norms 5, 3, inf (skipped), 10
    whole = GradNorms(torch.device("cpu"), capacity=2, counted=local_tensors)  # (the slots grow)
    for grads in steps:
        whole.add(grads)
    figures = whole.figures(whole.local_squares())
    assert figures == {"grad_norm": pytest.approx(6.0), "grad_norm_max": 10.0}  # (float32 norms)

    first = GradNorms(torch.device("cpu"), capacity=4, counted=local_tensors)
    for grads in steps[:2]:
        first.add(grads)
    first.figures(first.local_squares())  # reduced before a snapshot
    resumed = GradNorms(torch.device("cpu"), capacity=4, counted=local_tensors)
    resumed.load_state_dict(first.state_dict())
    for grads in steps[2:]:
        resumed.add(grads)
    assert resumed.figures(resumed.local_squares()) == figures  # exactly
    silent = GradNorms(torch.device("cpu"), capacity=4, counted=no_tensors)  # ddp's other ranks: the same length, zeros
    silent.add(steps[0])
    assert silent.local_squares().tolist() == [0.0]


def test_seed_sets_every_global_generator_a_task_may_draw_from():
    """Two fresh builds of a task that draws from Python's random and numpy get the same draws
    (--seed used to seed torch only); another seed, other draws."""
    import random

    import numpy as np

    from ddptrain import RunConfig, Task
    from ddptrain.tasks import build

    drawn = []

    def factory(cfg):
        drawn.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
        return Task(model=torch.nn.Linear(2, 1), train_set=torch.utils.data.TensorDataset(torch.ones(4, 2)),
                    loss_fn=torch.nn.functional.mse_loss)

    for seed in (3, 3, 4):
        random.seed()  # whatever state the process was in before
        np.random.seed(None)
        build(RunConfig(seed=seed), factory)
    assert drawn[0] == drawn[1] and all(a != b for a, b in zip(drawn[0], drawn[2]))
