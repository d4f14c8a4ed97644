"""Watching a run, the pure logic (issue 68): the step window's sums, the schedule's floor, the
nearest flag, the curves' series, config.json's record of what was built, --eval-batches'
subset, the summary's wall. In this process, no ranks."""

import json
import math

import pytest
import torch
from torch.utils.data import Subset, TensorDataset

from ddptrain import ConfigError, RunConfig
from ddptrain.cli import main
from ddptrain.data import eval_subset
from ddptrain.observe.report import config_json, console_line
from ddptrain.observe.step_figures import StepFigure
from ddptrain.observe.step_records import StepWindow
from ddptrain.observe.summary import curve_series, format_summary, summarize
from ddptrain.observe.tracking import metrics_of, params_of
from ddptrain.optim import build_schedule, describe_optimizer, lr_factor, run_steps
from ddptrain.settings import OPTIMIZER_SETTINGS, unset_settings
from ddptrain.settings.checks import validate
from ddptrain.settings.parsing import from_options, nearest_flag, read_settings_file


def _window(losses, norms, every=10):
    window = StepWindow(torch.device("cpu"), every)
    for loss, norm in zip(losses, norms):
        window.add(None if loss is None else torch.tensor(loss), torch.tensor(norm, dtype=torch.float64))
    return window


def _record(window, *others):
    """The record of ``window``'s steps, its part summed with ``others``' (the ranks' all-reduce)."""
    part, carried, _, _ = window.take()
    return window.with_part(carried, sum((other.take()[0] for other in others), part)).record(window.figures)


def test_the_step_window_is_the_mean_over_its_steps_of_the_ranks_summed_parts():
    # two ranks' parts of three steps (each step's loss: the parts' sum); ddp: rank 0 holds the norm
    rank0, rank1 = _window([0.5, 1.0, None], [3.0, 4.0, math.inf]), _window([0.5, 2.0, None], [0.0, 0.0, 0.0])
    figures = _record(rank0, rank1)
    assert figures == {"train_loss": pytest.approx((1.0 + 3.0) / 2), "grad_norm": pytest.approx(3.5)}  # skipped: out
    assert rank0.count == 0 and rank0.state_dict() == {"window_loss_total": 0.0, "window_loss_steps": 0,  # a new
                                                       "window_grad_norm_total": 0.0, "window_grad_norm_steps": 0}
    # a non-finite loss that was not skipped shows in the record (the guard stops the run at its next check)
    assert math.isnan(_record(_window([1.0, math.nan], [1.0, 1.0]))["train_loss"])


def test_a_window_folded_for_a_snapshot_carries_its_figures_into_the_resumed_record():
    expected = _record(_window([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 2.0, 2.0]))
    before = _window([1.0, 2.0], [1.0, 1.0])
    before.fold(before.local_part())  # the snapshot's reduction
    resumed = StepWindow(torch.device("cpu"), 10)
    resumed.load_state_dict(before.state_dict())
    for loss, norm in ((3.0, 2.0), (4.0, 2.0)):
        resumed.add(torch.tensor(loss), torch.tensor(norm, dtype=torch.float64))
    assert _record(resumed) == pytest.approx(expected)


FIGURES = (StepFigure("aux", "mean"), StepFigure("peak", "max"), StepFigure("tokens", "sum"))


def _figures_window(rank, steps, every=10):
    """A window of rank ``rank`` of 3, each step's task figures given (a figure left out: none that step)."""
    window = StepWindow(torch.device("cpu"), every, FIGURES, rank=rank, world_size=3)
    for figures in steps:
        window.add(torch.tensor(1.0), torch.tensor(1.0, dtype=torch.float64),
                   {k: torch.tensor(float(v), dtype=torch.float64) for k, v in figures.items()})
    return window


def test_a_tasks_figures_combine_over_ranks_and_steps_as_declared():
    ranks = [_figures_window(0, [{"aux": 1, "peak": -5, "tokens": 10}, {"aux": 3, "peak": -7, "tokens": 10}]),
             _figures_window(1, [{"aux": 2, "peak": -2, "tokens": 4}, {"tokens": 4}]),  # no aux, peak at step 2
             _figures_window(2, [{}, {}])]  # none at all: no value, and its -inf never wins
    figures = _record(*ranks)
    assert figures["aux"] == pytest.approx((1 + 3 + 2) / 3) and figures["tokens"] == 28
    assert (figures["peak"], figures["peak_rank"]) == (-2, 1)
    assert "aux" not in _record(_figures_window(0, [{}]), _figures_window(1, [{}]), _figures_window(2, [{}]))


def test_a_snapshot_inside_a_window_carries_the_tasks_figures():
    steps = [[{"aux": 1, "peak": 4, "tokens": 1}, {"aux": 5, "peak": 9, "tokens": 2}],
             [{"aux": 2, "peak": 1, "tokens": 3}, {"aux": 2, "peak": 3, "tokens": 4}], [{}, {}]]
    expected = _record(*[_figures_window(r, s) for r, s in enumerate(steps)])
    before = [_figures_window(r, s[:1]) for r, s in enumerate(steps)]
    summed = sum(window.local_part() for window in before)
    resumed = []
    for rank, window in enumerate(before):
        window.fold(summed)
        again = StepWindow(torch.device("cpu"), 10, FIGURES, rank=rank, world_size=3)
        again.load_state_dict(window.state_dict())
        resumed.append(again)
    for rank, s in enumerate(steps):
        resumed[rank].add(torch.tensor(1.0), torch.tensor(1.0, dtype=torch.float64),
                          {k: torch.tensor(float(v), dtype=torch.float64) for k, v in s[1].items()})
    assert _record(*resumed) == pytest.approx(expected)
    assert (expected["peak"], expected["peak_rank"], expected["tokens"]) == (9, 0, 10)


def test_a_figure_of_ddptrains_own_is_measured_by_each_rank_after_each_step():
    readings = iter([3.0, 7.0, 5.0, 2.0])
    peak = (StepFigure("peak_mb", "max", measure=lambda: next(readings)),)
    ranks = [StepWindow(torch.device("cpu"), 10, peak, rank=rank, world_size=2) for rank in range(2)]
    for _ in range(2):
        for window in ranks:
            window.add(torch.tensor(1.0), torch.tensor(1.0, dtype=torch.float64))
    assert {k: v for k, v in _record(*ranks).items() if k.startswith("peak")} == {"peak_mb": 7.0, "peak_mb_rank": 1}


def test_a_tasks_figures_are_declared_and_returned_or_refused_in_one_line():
    from ddptrain.tasks.protocol import check_step_figures, split_figures

    loss = torch.tensor(1.0, requires_grad=True)
    assert split_figures({"loss": loss, "aux": 2.0}, {"aux": "mean"}, check=True) == (loss, {"aux": 2.0})
    assert split_figures({"loss": loss, "count": 3}, {}, check=True) == ((loss, 3), {})
    assert split_figures(loss, {}) == (loss, {})
    for value, match in (({"aux": 1.0}, "without 'loss'"), ({"loss": loss, "other": 1.0}, "does not declare"),
                         ({"loss": loss, "aux": torch.ones(3)}, "one-element")):
        with pytest.raises(ConfigError, match=match):
            split_figures(value, {"aux": "mean"}, check=True)
    for declared, match in (({"aux": "median"}, "choose how"), ({"train_loss": "mean"}, "none of the record"),
                            ({"x_rank": "max"}, "_rank"), (["aux"], "give a dict")):
        with pytest.raises(ConfigError, match=match):
            check_step_figures(declared, "t")


def test_log_every_defaults_to_ten_or_four_records_in_a_short_run():
    cfg = RunConfig()
    assert [cfg.log_interval(n) for n in (None, 1000, 40, 39, 9, 2)] == [10, 10, 10, 9, 2, 1]
    assert RunConfig(log_every=0).log_interval(1000) == 0 and RunConfig(log_every=3).log_interval(5) == 3


def test_cosine_and_linear_decay_to_the_floor():
    cosine, linear = lr_factor("cosine", 2, 12, floor=0.1), lr_factor("linear", 0, 10, floor=0.2)
    assert cosine(0) == 0.5 and cosine(2) == pytest.approx(1.0) and cosine(12) == pytest.approx(0.1)
    assert cosine(7) == pytest.approx(0.1 + 0.9 * 0.5)
    assert linear(5) == pytest.approx(0.6) and linear(10) == pytest.approx(0.2)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = RunConfig(lr=0.5, lr_schedule="cosine", min_lr=0.05, max_steps=4)
    schedule = build_schedule(optimizer, cfg.optim, run_steps(cfg.training, None))
    for _ in range(4):
        optimizer.step()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_a_tasks_schedule_replaces_the_flags_and_refuses_them_beside_it():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)

    def make(opt, total):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=total)
    def schedule(**options):
        cfg = RunConfig(**options)
        return build_schedule(optimizer, cfg.optim, run_steps(cfg.training, None), make)
    assert isinstance(schedule(max_steps=8), torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ConfigError, match="make_scheduler"):
        schedule(max_steps=8, min_lr=0.1)
    with pytest.raises(ConfigError, match="--max-steps"):
        schedule(max_epochs=2)  # a stream: no length


def test_betas_and_eps_reach_adamw_and_bad_ones_are_one_line():
    assert RunConfig(betas="0.9, 0.95").adam_betas == (0.9, 0.95)
    for bad in ("0.9", "0.9,1.0", "a,b"):
        with pytest.raises(ConfigError, match="--betas"):
            validate(RunConfig(betas=bad))
    for cfg, match in ((RunConfig(eps=0.0), "--eps"), (RunConfig(lr=0.1, min_lr=0.2), "--min-lr"),
                       (RunConfig(final_eval="same"), "--eval-batches"), (RunConfig(log_every=-1), "--log-every")):
        with pytest.raises(ConfigError, match=match):
            validate(cfg)


def test_the_math_fingerprint_holds_the_new_knobs_only_where_they_are_set():
    plain = RunConfig(optimizer="adamw", lr=0.1, momentum=0.0, weight_decay=0.0).math_fingerprint(2)
    assert not {"min_lr", "betas", "eps"} & set(plain)  # 0.5's snapshots match
    changed = RunConfig(optimizer="adamw", lr=0.1, momentum=0.0, weight_decay=0.0, betas="0.9,0.95",
                        min_lr=0.01).math_fingerprint(2)
    assert changed["betas"] == "0.9,0.95" and changed["min_lr"] == 0.01
    from ddptrain.snapshots.files import SnapshotError, check_fingerprint
    with pytest.raises(SnapshotError, match="betas"):  # set before, left at the default now
        check_fingerprint(changed, plain, "step-1.pt")
    assert RunConfig(betas="0.9,0.95").identity() != RunConfig().identity()
    assert RunConfig(log_every=5, eval_batches=3).identity() == RunConfig().identity()  # the same run dir


@pytest.mark.parametrize("name,meant", [("--log_interval", "--log-every"), ("eval_iters", "--eval-batches"),
                                        ("--max-epoch", "--max-epochs"), ("learning_rate", "--lr"),
                                        ("--logging-steps", "--log-every"), ("beta2", "--betas"), ("--zzz", None)])
def test_an_unknown_setting_gets_its_nearest_flag(name, meant):
    assert nearest_flag(name) == meant


def test_an_unknown_flag_is_one_line_naming_the_nearest_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--log_interval", "10"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--log_interval" in err and "did you mean --log-every?" in err
    with pytest.raises(ConfigError, match=r"did you mean --eval-batches\?"):
        from_options({"eval_iters": 20}, "--config run.toml: key")


def test_curves_are_drawn_by_step_from_step_records_and_evaluations():
    records = [
        {"kind": "step", "epoch": 0, "step": 10, "train_loss": 2.0},
        {"kind": "eval", "epoch": 0, "step": 15, "eval_loss": 1.9, "eval_samples": 64},
        {"kind": "step", "epoch": 0, "step": 20, "train_loss": 1.5},
        {"kind": "epoch", "epoch": 0, "step": 23, "train_loss": 1.7, "eval_loss": 1.6, "eval_samples": 359},
        {"kind": "step", "epoch": 1, "step": 30, "train_loss": 1.2},
        {"kind": "epoch", "epoch": 1, "step": 35, "train_loss": 1.1, "partial": True, "eval_loss": 1.3},
        {"kind": "goodput", "step": 35, "goodput": 0.5},
    ]
    series = curve_series(records)
    assert series == {"train_loss": [[10, 2.0], [20, 1.5], [30, 1.2]],
                      "eval_loss": [[15, 1.9], [23, 1.6], [35, 1.3]], "epochs": [[0, 23]]}
    epochs_only = curve_series([r for r in records if r["kind"] != "step"])
    assert epochs_only["train_loss"] == [[23, 1.7], [35, 1.1]]  # a run without step records: its epochs
    # the learning rate at each step record; an evaluation on --eval-batches' subset apart from the
    # whole set's (one line joined them, with no marker)
    records[0]["lr"], records[2]["lr"] = 0.1, 0.05
    records[1]["evaluated_on"] = "--eval-batches subset"
    series = curve_series(records)
    assert series["lr"] == [[10, 0.1], [20, 0.05]]
    assert series["eval_loss_subset"] == [[15, 1.9]] and series["eval_loss"] == [[23, 1.6], [35, 1.3]]


def test_a_step_records_console_line_leads_with_its_step():
    line = console_line({"kind": "step", "epoch": 2, "step": 130, "train_loss": 1.95, "grad_norm": 0.5, "lr": 0.001,
                         "samples_per_s": 12345.6, "tokens_per_s": 1000.0})
    assert line == ("step 130 | epoch 2 | train_loss 1.95 | grad_norm 0.5 | lr 0.001 | 12,346 samples/s | "
                    "1,000 tokens/s")


def test_config_json_says_what_was_built_and_reads_back_as_settings(tmp_path):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1},
                                   {"params": [model.bias], "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    built = describe_optimizer(optimizer, schedule)
    given = RunConfig(momentum=0.5)  # the user's --momentum: kept (a task may read it), the rest null
    unused = unset_settings(given, OPTIMIZER_SETTINGS)
    assert unused == ("optimizer", "weight_decay", "betas", "eps")
    cfg = given.with_task_defaults({})
    written = json.loads(config_json(cfg.settings(), built, unused))
    groups = written["built"]["optimizer"]["param_groups"]
    assert written["built"]["optimizer"]["class"] == "AdamW" and written["built"]["scheduler"]["class"] == "LambdaLR"
    assert [(g["weight_decay"], g["betas"], g["lr"], g["parameters"]) for g in groups] == [
        (0.1, [0.9, 0.95], 3e-3, 8), (0.0, [0.9, 0.95], 3e-3, 2)]  # lr: the schedule's base
    assert written["optimizer"] is None and written["weight_decay"] is None and written["betas"] is None
    assert written["momentum"] == 0.5 and written["lr"] == 1e-3
    assert json.loads(config_json(cfg.settings(), built))["optimizer"] == "sgd"
    (tmp_path / "config.json").write_text(config_json(cfg.settings(), built, unused))
    settings = read_settings_file(tmp_path / "config.json")
    assert "built" not in settings and from_options({k: v for k, v in settings.items() if v is not None})
    params = params_of(written)
    assert params["built/optimizer/param_groups/1/weight_decay"] == "0.0" and params["built/optimizer/class"] == "AdamW"
    assert max(len(v) for v in params.values()) < 100  # trackers keep short values (MLflow: 500 characters)


def test_eval_batches_draws_the_same_samples_whatever_the_world_size():
    data = TensorDataset(torch.arange(100.0), torch.arange(100))
    subset = eval_subset(data, 24, seed=3)
    assert isinstance(subset, TensorDataset) and len(subset) == 24  # the fast path stays
    again = eval_subset(data, 24, seed=3)
    assert torch.equal(subset.tensors[0], again.tensors[0]) and subset.tensors[0].tolist() == sorted(
        subset.tensors[0].tolist())
    assert not torch.equal(subset.tensors[0], eval_subset(data, 24, seed=4).tensors[0])
    assert eval_subset(data, 500, seed=3) is data
    listed = eval_subset(list(range(100)), 24, seed=3)  # any map-style set: a Subset of the same samples
    assert isinstance(listed, Subset) and [listed[i] for i in range(24)] == subset.tensors[1].tolist()


def test_the_summarys_wall_is_the_runs_over_every_attempt(tmp_path):
    records = [{"kind": "epoch", "epoch": 0, "step": 5, "train_loss": 1.0, "epoch_time_s": 2.0},
               {"kind": "goodput", "step": 5, "goodput": 0.4, "attempts": 2, "wall_s": 9.5, "steps_redone": 1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = summarize(tmp_path)
    assert summary["wall_time_s"] == 9.5 and summary["attempts"] == 2
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")  # a run not ended: its epochs
    assert summarize(tmp_path)["wall_time_s"] == 2.0


def test_the_summary_shows_the_last_window_s_loss_beside_the_epoch_s_mean(tmp_path):
    """The last epoch's mean reaches back to its first step; the newest step record's window is
    where the run ended: both in the summary, each said for what it is."""
    records = [{"kind": "step", "epoch": 0, "step": 10, "train_loss": 2.6},
               {"kind": "step", "epoch": 0, "step": 20, "train_loss": 2.168},
               {"kind": "epoch", "epoch": 0, "step": 23, "train_loss": 2.437, "epoch_time_s": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = summarize(tmp_path)
    assert (summary["train_loss"], summary["train_loss_last_window"], summary["last_window"]) == \
        (2.437, 2.168, "steps 11-20")
    shown = format_summary(summary)
    assert "train_loss              2.437 (the last epoch's mean)" in shown
    assert "train_loss_last_window  2.168\n  last_window             steps 11-20" in shown
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[2]) + "\n")  # no step records: no window
    assert "last_window" not in summarize(tmp_path)


def test_trackers_get_a_step_records_figures_apart_from_an_epochs_at_the_same_step():
    step = metrics_of({"kind": "step", "epoch": 0, "step": 20, "train_loss": 1.5, "lr": 0.1, "time": 5.0})
    epoch = metrics_of({"kind": "epoch", "epoch": 0, "step": 20, "train_loss": 1.7, "lr": 0.1, "time": 5.0})
    assert step == {"step/epoch": 0.0, "step/train_loss": 1.5, "step/lr": 0.1}
    assert not set(step) & set(epoch)  # each (metric, step) once: neither hides the other
