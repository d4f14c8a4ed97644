"""What a run's records say, read back: metrics.jsonl, the summary a finished run prints (and
``ddptrain report``), the curves plot, and the formatting they share with the console lines
(report.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

EVALUATED = ("eval_", "ema_eval_")  # an evaluation's figures: of the weights, and of --ema's average


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def format_percent(share: float) -> str:
    """A share as a percentage with its leading digits: a small model's MFU of 4e-5 is 0.004%, not 0.0%."""
    return f"{share:.1%}" if share >= 0.01 else f"{share * 100:.2g}%"


SUMMARY_NOTES = {"train_loss": "the last epoch's mean"}  # what a figure is, where its name alone misleads


def format_summary(summary: dict[str, Any]) -> str:
    width = max((len(k) for k in summary), default=0)
    lines = ["summary"] + [f"  {k.ljust(width)}  {format_value(v)}"
                           + (f" ({SUMMARY_NOTES[k]})" if k in SUMMARY_NOTES else "") for k, v in summary.items()]
    return "\n".join(lines)


def curve_series(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``curves.png`` draws, by optimizer step: ``train_loss`` at each step record
    (--log-every; a run without them: at each epoch's end), every evaluation figure at the step
    it was taken (on --eval-batches' subset: ``<name>_subset``, apart from the whole set's),
    ``lr`` at each step record, and ``epochs``: the step each epoch ended at. ``report --json``
    holds it too."""
    steps = [r for r in records if r.get("kind") == "step"]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    trained = steps or epochs
    series: dict[str, Any] = {"train_loss": [[r["step"], r["train_loss"]] for r in trained
                                             if isinstance(r.get("train_loss"), (int, float))]}
    names = sorted({k for r in records for k in r if k.startswith(EVALUATED) and not k.endswith("eval_samples")})
    for name in names:  # an evaluation's own record and an epoch's that carries one, each step once
        for subset, key in ((False, name), (True, f"{name}_subset")):
            points = {r["step"]: r[name] for r in records
                      if isinstance(r.get(name), (int, float)) and bool(r.get("evaluated_on")) == subset}
            if points or not subset:
                series[key] = [[step, value] for step, value in sorted(points.items())]
    rates = [[r["step"], r["lr"]] for r in steps if isinstance(r.get("lr"), (int, float))]
    if rates:
        series["lr"] = rates
    series["epochs"] = [[r["epoch"], r["step"]] for r in epochs if not r.get("partial")]
    return series


def plot_curves(run_dir: Path) -> str | None:
    """Draw ``curves.png`` from metrics.jsonl (``curve_series``, x in optimizer steps, the epochs'
    ends marked on a second axis when there are several); a one-line note instead if matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "curves.png not drawn: matplotlib is not installed (pip install 'ddptrain[plot]')"
    series = curve_series(read_metrics(run_dir))
    if not any(points for name, points in series.items() if name != "epochs"):
        return "curves.png not drawn: no step logged, no epoch finished, no evaluation"
    panels = [("loss", ["train_loss", "eval_loss", "eval_loss_subset", "ema_eval_loss", "ema_eval_loss_subset"])]
    extra = [k for k in series if k.startswith("eval_") and not k.startswith("eval_loss") and not k.endswith("_subset")]
    panels += [(k.removeprefix("eval_"), [k, f"{k}_subset", f"ema_{k}", f"ema_{k}_subset"]) for k in extra]
    if series.get("lr"):
        panels.append(("learning rate", ["lr"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (title, keys) in zip(axes[0], panels):
        for key in keys:
            points = series.get(key, [])
            if points:
                many = len(points) > 40  # a step-logged loss: a line; evaluations: points on it
                subset = key.endswith("_subset")  # --eval-batches' samples: hollow, apart from the whole set's
                ax.plot(*zip(*points), marker="" if many else ("s" if subset else "o"), markersize=4,
                        fillstyle="none" if subset else "full", linestyle=":" if subset else "-",
                        label=f"{key.removesuffix('_subset')} (--eval-batches subset)" if subset else key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
        ends = series["epochs"]
        if len(ends) > 1:  # the epochs' ends on top, where there are several
            top = ax.secondary_xaxis("top")
            shown = ends[::max(1, len(ends) // 8)]
            top.set_xticks([step for _, step in shown], labels=[str(epoch + 1) for epoch, _ in shown])
            top.set_xlabel("epochs done", fontsize=8)
            top.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(run_dir / "curves.png", dpi=110)
    plt.close(fig)
    return None


def summarize(run_dir: Path) -> dict[str, Any]:
    """The final summary, rebuilt from metrics.jsonl (also what ``ddptrain report`` prints).
    ``wall_time_s``: the run's wall over every attempt (goodput's), once it ended; before, its
    epochs' time; the rates: training alone (evaluations and snapshots left out)."""
    records = read_metrics(run_dir)
    epochs = [r for r in records if r.get("kind") == "epoch"]
    goodput = [r for r in records if r.get("kind") == "goodput"]
    summary: dict[str, Any] = {
        "epochs": epochs[-1]["epoch"] + 1 if epochs else 0,
        "steps": max((r["step"] for r in records), default=0),
        "wall_time_s": round(goodput[-1]["wall_s"] if goodput and "wall_s" in goodput[-1]
                             else sum(r.get("epoch_time_s", 0.0) for r in epochs), 2),
    }
    for name in ("samples_per_s", "tokens_per_s", "tflops", "mfu"):
        rates = [r[name] for r in epochs if r.get(name)]
        if rates:  # rates to 0.1; TFLOP/s and MFU to 3 significant digits (a small model's are not 0)
            mean = sum(rates) / len(rates)
            summary[name] = round(mean, 1) if name.endswith("_per_s") else float(f"{mean:.3g}")
    if epochs:
        summary["train_loss"] = epochs[-1]["train_loss"]  # the last epoch's mean
    summary.update(last_window(records))
    evaluated = [r for r in records if any(k.startswith("eval_") for k in r)]
    if evaluated:
        summary.update({k: v for k, v in evaluated[-1].items() if k.startswith(EVALUATED)})
        if any("evaluated_on" in r for r in evaluated):  # --eval-batches: which set the last figures are of
            summary["evaluated_on"] = evaluated[-1].get("evaluated_on", "the whole evaluation set")
    best = Path(run_dir) / "best" / "best.json"  # --keep-best (snapshots/best.py)
    if best.is_file():
        kept = json.loads(best.read_text())
        summary[f"best_{kept['metric']}"], summary["best_step"] = kept["value"], kept["step"]
    if goodput:
        summary["goodput"] = goodput[-1]["goodput"]
        if goodput[-1]["attempts"] > 1:
            summary["attempts"], summary["steps_redone"] = goodput[-1]["attempts"], goodput[-1]["steps_redone"]
    if epochs and "samples_skipped" in epochs[-1]:  # --fault-tolerance torchft: what missing groups missed
        summary["samples_skipped"] = epochs[-1]["samples_skipped"]
    skipped = [step for r in epochs for step in r.get("skipped_steps", [])]
    if skipped:
        summary["skipped_steps"] = len(skipped)
    slow = stragglers(epochs)
    if slow:
        summary["stragglers"] = slow
    return summary


def last_window(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The newest step record's training loss (--log-every's window: where the run ended, where the
    epoch's mean ``train_loss`` reaches back to the epoch's start) and the steps it spans."""
    windows = [r for r in records if r.get("kind") == "step" and isinstance(r.get("train_loss"), (int, float))]
    if not windows:
        return {}
    last = windows[-1]
    before = [r["step"] for r in windows[:-1] if r["step"] < last["step"]]
    return {"train_loss_last_window": last["train_loss"],
            "last_window": f"steps {before[-1] + 1 if before else 1}-{last['step']}"}


def stragglers(epochs: list[dict[str, Any]]) -> str:
    """"rank 1 (2/2 epochs, up to 3.1x the median rank)" for every rank named in an epoch record."""
    named: dict[str, list[float]] = {}
    for record in epochs:
        for rank, ratio in record.get("stragglers", {}).items():
            named.setdefault(rank, []).append(ratio)
    return "; ".join(f"rank {rank} ({len(ratios)}/{len(epochs)} epochs, up to {max(ratios):.1f}x the "
                     "median rank's data + compute time)" for rank, ratios in sorted(named.items()))
