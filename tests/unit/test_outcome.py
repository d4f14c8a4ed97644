"""What a run that already reached its limits says when run again (no process needed)."""

import re

import pytest

from ddptrain import RunConfig
from ddptrain.launch.rank import finished_message

MODEL = "runs/x/model.pt"


def _advice(message: str) -> dict[str, int]:
    """The flags the message tells the user to pass: {flag: the value above which to pass}."""
    return {flag: int(at) for flag, at in re.findall(r"a larger (--max-\w+) \(above (\d+)\)", message)}


@pytest.mark.parametrize("limits,epoch,step,said,advised", [
    # --max-epochs 2 on 32 steps an epoch: ended at the epoch limit
    ({"max_epochs": 2}, 2, 64, "already finished 2 epoch(s); its model is runs/x/model.pt. It reached "
     "--max-epochs 2 at step 64", {"--max-epochs": 2}),
    # --max-epochs 3 --max-steps 50: the step limit ended it inside epoch 1
    ({"max_epochs": 3, "max_steps": 50}, 1, 50, "already finished 50 step(s); its model is runs/x/model.pt. It "
     "reached --max-steps 50 at step 50", {"--max-steps": 50}),
    # a 190-step run rerun with --max-steps 100: it stands past the new limit
    ({"max_steps": 100}, 5, 190, "already finished 190 step(s)", {"--max-steps": 190}),
    # both limits at once
    ({"max_epochs": 2, "max_steps": 64}, 2, 64, "already finished 2 epoch(s) and 64 step(s)",
     {"--max-epochs": 2, "--max-steps": 64}),
])
def test_the_message_names_the_limit_reached_and_its_advice_trains_on(limits, epoch, step, said, advised):
    cfg = RunConfig(**limits)
    message = finished_message("runs/x", cfg, epoch, step, MODEL)
    assert said in message and message.count("\n") == 0
    assert _advice(message) == advised
    # following the advice (one above each value named) leaves the run short of every limit
    followed = RunConfig(**{**limits, **{flag[2:].replace("-", "_"): at + 1 for flag, at in advised.items()}})
    assert epoch < followed.epochs and (followed.max_steps is None or step < followed.max_steps)


def _refused(before: RunConfig, after: RunConfig) -> bool:
    """Whether a resume under ``after`` of a run made under ``before`` is refused (its math changed)."""
    from ddptrain.settings.fingerprint import math_fingerprint

    return math_fingerprint(before, 2) != math_fingerprint(after, 2)


def test_the_advice_is_what_a_resume_accepts_and_a_decaying_schedule_is_told_to_start_anew():
    """A larger --max-steps resumes a run at a constant rate; under a decay spanning the run it
    would change every step's rate, and a resume refuses it (#78): the message says so and how to
    train on from the weights instead."""
    constant = RunConfig(max_steps=100)
    assert _advice(finished_message("runs/x", constant, 3, 100, MODEL)) == {"--max-steps": 100}
    assert not _refused(constant, RunConfig(max_steps=150))
    cosine = RunConfig(max_steps=100, lr_schedule="cosine", warmup_steps=10)
    message = finished_message("runs/x", cosine, 3, 100, MODEL)
    assert _refused(cosine, RunConfig(max_steps=150, lr_schedule="cosine", warmup_steps=10))
    assert _advice(message) == {} and message.count("\n") == 0
    assert ("its --lr-schedule cosine (--warmup-steps 10) spans those steps, so a longer run would change every "
            "step's rate and is refused; to train on, start a new run from its weights: --init-from "
            "runs/x/model.pt --run-dir ANOTHER (its optimizer afresh; --init-from runs/x --init-optimizer carries its "
            "optimizer's state too)") in message, message


def test_a_run_stopped_before_its_model_says_so():
    message = finished_message("runs/x", RunConfig(max_steps=10), 0, 10, None)
    assert "was stopped past 10 step(s), before model.pt" in message
