"""Learning-rate schedules against the formulas they claim: nanoGPT's ``get_lr`` step by step."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ddptrain.optim import lr_factor, nanogpt_schedule
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
