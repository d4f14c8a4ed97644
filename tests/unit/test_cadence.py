"""Cadence: what is due after each step, from the limits and intervals (progress.py). Each rule
alone, then where rules meet: the combinations the training loop once got wrong by hand."""

from __future__ import annotations

import pytest

from ddptrain.progress import Action, Cadence, Progress
from ddptrain.settings import RunConfig


def cadence(steps_per_epoch: int | None = 10, evaluates: bool = True, early: list[bool] | None = None,
            **options) -> tuple[Cadence, Progress]:
    progress = Progress(steps_per_epoch=steps_per_epoch)
    stopped = early if early is not None else [False]
    cfg = RunConfig(**options)
    return Cadence(cfg.training, cfg.evaluation, cfg.save_every, progress, evaluates,
                   stopped_early=lambda: stopped[0]), progress


def run_to(progress: Progress, global_step: int) -> None:
    """Steps taken until ``global_step``, epochs turned over as the loop does."""
    while progress.global_step < global_step:
        if progress.epoch_over:
            progress.next_epoch()
        progress.step_done(1)


def actions(c: Cadence, progress: Progress, steps: int, **signal) -> list[Action]:
    out = []
    for _ in range(steps):
        if progress.epoch_over:
            progress.next_epoch()
        progress.step_done(1)
        out.append(c.after_step(**signal))
    return out


def test_a_plain_step_needs_nothing():
    c, progress = cadence()
    (action,) = actions(c, progress, 1)
    assert action == Action() and not action.leaves_epoch and not action.save_now


def test_max_epochs_ends_the_run_after_its_last_epoch():
    c, progress = cadence(max_epochs=2)
    run_to(progress, 20)
    assert not c.done()  # the second epoch's record is not yet written
    progress.next_epoch()
    assert c.done() and progress.epoch == 2


def test_max_steps_ends_the_run_at_its_step_inside_an_epoch():
    c, progress = cadence(max_steps=13)
    seen = actions(c, progress, 13)
    assert [a.end for a in seen] == [False] * 12 + [True]
    assert seen[-1].leaves_epoch and not seen[-1].epoch_over and c.done() and c.steps_reached()


def test_max_steps_at_an_epochs_last_step_is_both_ends():
    c, progress = cadence(max_steps=10, save_every=5)
    last = actions(c, progress, 10)[-1]
    assert last.end and last.epoch_over and last.save_after_record and not last.save_now


def test_max_epochs_and_max_steps_the_first_reached_wins():
    c, progress = cadence(max_epochs=3, max_steps=100)
    run_to(progress, 30)
    progress.next_epoch()
    assert c.done() and not c.steps_reached()
    c, progress = cadence(max_epochs=30, max_steps=25)
    run_to(progress, 25)
    assert c.done() and c.steps_reached() and progress.epoch == 2


def test_save_every_inside_an_epoch_saves_now():
    c, progress = cadence(save_every=4)
    seen = actions(c, progress, 9)
    assert [i + 1 for i, a in enumerate(seen) if a.save_now] == [4, 8]


def test_a_save_at_an_epochs_last_step_waits_for_the_record():
    c, progress = cadence(save_every=5)
    seen = actions(c, progress, 10)
    assert seen[4].save_now and not seen[9].save_now and seen[9].save_after_record


def test_a_streams_epoch_is_never_over_in_advance_so_its_saves_happen_now():
    c, progress = cadence(steps_per_epoch=None, save_every=3)
    seen = actions(c, progress, 6)
    assert [a.save_now for a in seen] == [False, False, True, False, False, True]
    assert not any(a.epoch_over or a.save_after_record for a in seen)


def test_the_clocks_snapshot_request_saves_like_save_every():
    c, progress = cadence()
    (action,) = actions(c, progress, 1, snapshot_requested=True)
    assert action.save_now


def test_a_stop_signal_leaves_without_evaluating_or_saving_in_the_epoch():
    c, progress = cadence(save_every=1, eval_every_steps=1)
    (action,) = actions(c, progress, 1, stop_requested=True, snapshot_requested=True)
    assert action.stop and action.leaves_epoch
    assert not (action.evaluate or action.save_now or action.save_after_record)


def test_a_stop_at_an_epochs_last_step_keeps_the_record_but_not_the_in_epoch_save():
    c, progress = cadence(save_every=10)
    last = actions(c, progress, 10, stop_requested=False)[-1]
    stopped = c.after_step(stop_requested=True)
    assert last.save_after_record and stopped.stop and stopped.epoch_over and not stopped.save_after_record


def test_a_stop_at_the_runs_last_step_is_no_stop():
    c, progress = cadence(max_steps=3)
    seen = actions(c, progress, 3, stop_requested=True)
    assert seen[0].stop and not seen[2].stop and seen[2].end


def test_eval_every_steps_at_its_multiples_but_not_at_the_runs_end():
    c, progress = cadence(eval_every_steps=3, max_steps=9)
    seen = actions(c, progress, 9)
    assert [i + 1 for i, a in enumerate(seen) if a.evaluate] == [3, 6]  # step 9: the final evaluation does it


def test_eval_every_steps_without_an_eval_set_does_nothing():
    c, progress = cadence(eval_every_steps=1, evaluates=False)
    assert not any(a.evaluate for a in actions(c, progress, 5))


def test_an_evaluation_and_a_save_at_one_step_evaluate_first_then_save():
    c, progress = cadence(eval_every_steps=4, save_every=4)
    action = actions(c, progress, 4)[-1]
    assert action.evaluate and action.save_now  # the loop evaluates first: the snapshot holds the verdict


def test_early_stop_after_an_evaluation_ends_the_run_and_its_save_goes_to_the_end():
    early = [False]
    c, progress = cadence(eval_every_steps=4, save_every=4, early=early)
    action = actions(c, progress, 4)[-1]
    early[0] = True
    judged = c.judged(action)
    assert judged.end and judged.leaves_epoch and not judged.save_now and c.done()


def test_early_stop_at_an_epochs_last_step_still_saves_after_the_record():
    early = [False]
    c, progress = cadence(eval_every_steps=5, save_every=10, early=early)
    action = actions(c, progress, 10)[-1]
    early[0] = True
    judged = c.judged(action)
    assert judged.end and judged.epoch_over and judged.save_after_record


@pytest.mark.parametrize(("epoch", "partial", "options", "due"), [
    (0, False, {"max_epochs": 5}, True),  # every epoch by default
    (4, False, {"max_epochs": 5, "eval_every": 3}, True),  # the run's last epoch
    (1, False, {"max_epochs": 5, "eval_every": 2}, True),
    (2, False, {"max_epochs": 5, "eval_every": 2}, False),
    (0, True, {"max_epochs": 5, "max_steps": 3}, True),  # a partial epoch ends the run
    (1, False, {"max_epochs": 5, "eval_every": 0}, False),
])
def test_evaluation_at_an_epochs_end(epoch, partial, options, due):
    c, progress = cadence(**options)
    assert c.evaluate_at_epoch_end(epoch, partial) is due


def test_evaluation_at_the_epoch_where_max_steps_was_reached():
    c, progress = cadence(max_epochs=9, max_steps=20)
    run_to(progress, 20)
    assert c.evaluate_at_epoch_end(1, partial=False)
    assert not cadence(evaluates=False)[0].evaluate_at_epoch_end(4, partial=True)


@pytest.mark.parametrize(("steps", "options", "early", "follows"), [
    (10, {"eval_every_steps": 5}, False, True),  # the epoch's last step: its record carries the evaluation
    (10, {"eval_every_steps": 5, "eval_every": 2, "max_epochs": 5}, False, False),  # no evaluation in that record
    (5, {"eval_every_steps": 5}, False, False),  # inside the epoch: a record of its own
    (5, {"eval_every_steps": 5}, True, True),  # --early-stop ends the run here: the partial epoch's record
])
def test_an_evaluation_is_in_the_epochs_record_when_that_record_is_written_at_its_step(steps, options, early, follows):
    stopped = [False]
    c, progress = cadence(early=stopped, **options)
    action = actions(c, progress, steps)[-1]
    assert action.evaluate
    stopped[0] = early
    assert c.epoch_record_follows(0, c.judged(action)) is follows


def test_the_last_step_is_the_nearer_limit():
    from ddptrain import RunConfig
    from ddptrain.progress import Cadence, Progress

    def last(**limits):
        cfg = RunConfig(**limits)
        return Cadence(cfg.training, cfg.evaluation, cfg.save_every, Progress(steps_per_epoch=32),
                       evaluates=False).last_step(32)
    assert (last(max_epochs=3), last(max_steps=50), last(max_epochs=1, max_steps=50)) == (96, 50, 32)
