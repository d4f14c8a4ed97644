"""Learning-rate schedules against the formulas they claim: nanoGPT's ``get_lr`` step by step."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ddptrain.errors import ConfigError
from ddptrain.optim import nanogpt_schedule
from ddptrain.schedules import decay_start, lr_factor, schedule_agrees, stable_end, task_schedule_agrees
from ddptrain.settings import RunConfig
from ddptrain.settings.checks import validate
from ddptrain.snapshots.restore import TASK_SCHEDULE_LENGTH, Snapshot, TaskSchedule, resumed_config
from helpers.commands import fit

LEARNING_RATE, WARMUP_ITERS, LR_DECAY_ITERS, MIN_LR, MAX_ITERS = 6e-4, 20, 60, 6e-5, 70


def get_lr(it: int, learning_rate: float = LEARNING_RATE, warmup_iters: int = WARMUP_ITERS,
           lr_decay_iters: int = LR_DECAY_ITERS, min_lr: float = MIN_LR) -> float:
    """nanoGPT's train.py, as it is (karpathy/nanoGPT, master)."""
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


def test_nanogpt_schedule_is_get_lr_at_every_iteration_of_both_groups():
    """nanoGPT's two groups (decayed and not) at learning_rate, stepped as the Trainer steps a
    schedule (after each optimizer step), for max_iters + 1 steps (nanoGPT's iterations 0 to
    max_iters): the rate before each step is get_lr's, to the last bits' rounding."""
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.AdamW([{"params": params[:1], "weight_decay": 0.1},
                                   {"params": params[1:], "weight_decay": 0.0}], lr=LEARNING_RATE)
    scheduler = nanogpt_schedule(WARMUP_ITERS, LR_DECAY_ITERS, MIN_LR)(optimizer, MAX_ITERS + 1)
    for it in range(MAX_ITERS + 1):
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(get_lr(it), rel=1e-12, abs=0), it
        optimizer.step()
        scheduler.step()


def test_the_warm_up_of_warmup_steps_differs_from_nanogpt_s_as_the_page_says():
    """docs/from-nanogpt.md: --warmup-steps W rises as (s + 1) / W, nanoGPT's as (s + 1) / (W + 1)."""
    ours = lr_factor("cosine", WARMUP_ITERS, MAX_ITERS + 1)
    assert ours(0) == 1 / WARMUP_ITERS and get_lr(0) / LEARNING_RATE == pytest.approx(1 / (WARMUP_ITERS + 1))


def test_a_run_under_nanogpt_schedule_records_get_lr_at_each_step(tmp_path):
    """The same through the Trainer: each step record's rate (the one the next step takes, after
    ``step`` steps) is get_lr(step) for the test task's warm-up of 4 and decay to iteration 10."""
    fit("ddptrain_test_tasks:nanogpt_scheduled", tmp_path, nproc=1, max_steps=12, log_every=1, lr=0.05)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rates = {r["step"]: r["lr"] for r in records if r["kind"] == "step"}
    assert sorted(rates) == list(range(1, 13))
    for step, rate in rates.items():
        assert rate == pytest.approx(get_lr(step, 0.05, 4, 10, 1e-3), rel=1e-12), step


def test_a_decay_fraction_holds_the_rate_then_decays_over_the_run_s_last_share():
    """--decay-fraction 0.25 of 20 steps after a warm-up of 2: the rate holds at 1 from step 2 to
    14, then falls by the cosine over the last 5 steps (to the floor's share), as a decay over
    the whole span would over 5 steps."""
    factor = lr_factor("cosine", 2, 20, floor=0.1, decay_fraction=0.25)
    assert [factor(step) for step in range(2)] == [0.5, 1.0]
    assert all(factor(step) == 1.0 for step in range(2, 16))
    for k in range(5):
        assert factor(15 + k) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 5)), abs=1e-15)
    assert decay_start(2, 20, 0.25) == 15 and decay_start(2, 20, None) == 2
    assert decay_start(18, 20, 0.5) == 18  # never inside the warm-up


def test_the_snapshot_kept_before_a_decay_is_its_first_decayed_step_and_only_where_there_is_one():
    """schedules.stable_end: what the cadence saves and --keep spares (parts.make_cadence), and
    what a finished run's message names (launch/rank.py), one function for both."""
    def optim(**options):
        return RunConfig(**{"lr_schedule": "cosine", "warmup_steps": 2, "decay_fraction": 0.25, **options}).optim

    assert stable_end(optim(), 20) == 15
    assert stable_end(optim(), None) is None  # a run counted in epochs
    assert stable_end(optim(decay_fraction=None), 20) is None  # the decay spans the run
    assert stable_end(optim(lr_schedule="constant"), 20) is None  # no decay at all
    assert stable_end(optim(decay_fraction=0.01), 20) is None  # rounds to no decayed step: the run's end
    assert stable_end(optim(warmup_steps=0, decay_fraction=1.0), 20) is None  # decays from step 0


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_without_a_decay_fraction_every_rate_is_the_one_before_it(schedule):
    """Runs begun before --decay-fraction resume bitwise: their factors are 0.6's formula, bit for bit."""
    def before(step: int, warmup: int = 3, total: int = 17, floor: float = 0.2) -> float:  # 0.6's lr_factor
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * (1.0 - progress)
    ours = lr_factor(schedule, 3, 17, 0.2)
    assert [ours(step) for step in range(20)] == [before(step) for step in range(20)]


def _optim(**settings):
    return RunConfig(**settings).optim


def test_a_longer_run_agrees_with_the_rates_so_far_only_before_its_decay():
    """schedule_agrees(saved length, new length, the snapshot's step): warmup-stable-decay agrees
    up to the decay's start under the shorter length and not after; a whole-span cosine only
    inside its warm-up; a constant rate always."""
    wsd = _optim(lr_schedule="linear", warmup_steps=2, decay_fraction=0.25)
    assert schedule_agrees(wsd, 12, 20, 9) and schedule_agrees(wsd, 20, 12, 9)  # 12's decay starts at 9
    assert not schedule_agrees(wsd, 12, 20, 10)
    cosine = _optim(lr_schedule="cosine", warmup_steps=4)
    assert schedule_agrees(cosine, 12, 20, 3) and not schedule_agrees(cosine, 12, 20, 5)
    assert schedule_agrees(_optim(warmup_steps=4), 12, 20, 11)


def _snapshot(path, step: int, max_steps: int, cfg: RunConfig) -> Snapshot:
    return Snapshot(path, {"world_size": 2, "progress": {"global_step": step},
                           "fingerprint": cfg.replace(max_steps=max_steps).math_fingerprint(2)})


def test_a_resume_with_a_larger_max_steps_goes_on_before_the_decay_and_names_the_way_after(tmp_path):
    """resumed_config: --max-steps 12 -> 20 from step 9 (before 12's decay) is accepted in one
    line; from step 12 it is refused in one line that names the kept snapshot before the decay;
    any other change beside the length is refused as before."""
    cfg = RunConfig(lr_schedule="cosine", decay_fraction=0.25, max_steps=20)
    said: list[str] = []
    before_decay = tmp_path / "step-000000009.pt"
    before_decay.touch()
    assert resumed_config(_snapshot(before_decay, 9, 12, cfg), cfg, 2, said.append) == cfg
    assert said == ["--max-steps 12 → 20 at step 9: every step so far had the rate a run of 20 steps gives it, "
                    "so the run goes on as one started with 20 (its decay begins at step 15)"]
    with pytest.raises(ConfigError) as refused:
        resumed_config(_snapshot(tmp_path / "step-000000012.pt", 12, 12, cfg), cfg, 2, said.append)
    assert "cannot go on exactly; resume its snapshot from before the decay with --resume " \
           f"{before_decay}, or keep --max-steps 12" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"taken with other settings \(.*momentum"):
        resumed_config(_snapshot(before_decay, 9, 12, cfg), cfg.replace(momentum=0.5), 2, said.append)
    whole = RunConfig(lr_schedule="cosine", max_steps=20)
    with pytest.raises(ConfigError, match="with --decay-fraction F .* --init-from"):
        resumed_config(_snapshot(tmp_path / "step-000000012.pt", 12, 12, whole), whole, 2, said.append)


@pytest.mark.parametrize("settings,said", [
    ({"lr_schedule": "cosine", "decay_fraction": 1.5}, "--decay-fraction must be in (0, 1]"),
    ({"decay_fraction": 0.2}, "--decay-fraction belongs to a decaying --lr-schedule"),
])
def test_a_decay_fraction_out_of_range_or_without_a_decay_is_one_line(settings, said):
    with pytest.raises(ConfigError) as refused:
        validate(RunConfig(**settings))
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


def _over_the_run(optimizer, total_steps):
    """A task's schedule that spans the run: a linear decay over ``total_steps``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total_steps)


def test_a_task_s_own_schedule_is_tried_over_both_lengths():
    """nanoGPT's decays to its own lr_decay_iters whatever the run's length: every step agrees; one
    spanning the run agrees at step 0 only."""
    nanogpt = nanogpt_schedule(WARMUP_ITERS, LR_DECAY_ITERS, MIN_LR)
    assert task_schedule_agrees(nanogpt, [LEARNING_RATE, LEARNING_RATE], 71, 200, 70)
    assert task_schedule_agrees(_over_the_run, [0.1], 12, 20, 0)
    assert not task_schedule_agrees(_over_the_run, [0.1], 12, 20, 1)


def test_a_resume_under_another_length_of_a_task_s_schedule_is_checked_not_waved_through(tmp_path):
    """The length a task's schedule was given is in its snapshots (it is out of the settings'
    fingerprint under a constant --lr-schedule): another --max-steps is accepted where the schedule
    agrees, refused in one line where it does not; a snapshot from before this held none."""
    cfg = RunConfig(max_steps=20)
    def snapshot(length):
        fingerprint = {**RunConfig(max_steps=12).math_fingerprint(2),
                       **({TASK_SCHEDULE_LENGTH: length} if length else {})}
        return Snapshot(tmp_path / "step-000000006.pt", {"world_size": 2, "progress": {"global_step": 6},
                                                        "fingerprint": fingerprint})
    said: list[str] = []
    nanogpt = TaskSchedule(nanogpt_schedule(4, 10, 1e-3), [0.05])
    assert resumed_config(snapshot([12, math.inf]), cfg, 2, said.append, nanogpt) == cfg
    assert said == ["--max-steps 12 → 20 at step 6: the task's schedule gave every step so far the rate a run of 20 "
                    "steps gives it, so the run goes on as one started with 20"]
    with pytest.raises(ConfigError, match=r"whose task builds its own schedule .* so it cannot go on exactly; keep "
                                          r"--max-steps 12, or start a new run .* --init-optimizer$"):
        resumed_config(snapshot([12, math.inf]), cfg, 2, said.append, TaskSchedule(_over_the_run, [0.05]))
    assert resumed_config(snapshot(None), cfg, 2, said.append, TaskSchedule(_over_the_run, [0.05])) == cfg
