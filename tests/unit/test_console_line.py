"""An epoch record's console line (observe/report.console_line)."""

from ddptrain.observe.report import console_line


def test_a_partial_epoch_names_the_limit_that_ended_it_and_the_averages_figures_show():
    record = {"kind": "epoch", "epoch": 3, "step": 70, "train_loss": 0.25, "lr": 0.003, "eval_loss": 0.5,
              "eval_samples": 359, "ema_eval_loss": 0.4, "ema_eval_samples": 359, "partial": True,
              "ended_by": "--early-stop", "samples_per_s": 1000.0, "epoch_time_s": 0.5}
    assert console_line(record) == ("epoch 3 (partial: --early-stop) | step 70 | train_loss 0.25 | lr 0.003 | "
                                    "eval_loss 0.5 | ema_eval_loss 0.4 | 1,000 samples/s | 0.50 s")
    older = {k: v for k, v in record.items() if k != "ended_by"}  # metrics.jsonl of 0.3: --max-steps only
    assert console_line(older).startswith("epoch 3 (partial: --max-steps) | ")
