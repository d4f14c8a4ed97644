"""What a run tells people: rank 0's console lines, progress bar, metrics.jsonl, the
experiment trackers (tracking.py), the curves plot and the final summary. Other ranks get a
Reporter that does nothing.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..console import say
from ..settings import BUILT, ObservationSettings
from .goodput import Timeline, goodput_figures
from .tracking import Tracking


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def _percent(share: float) -> str:
    """A share as a percentage with its leading digits: a small model's MFU of 4e-5 is 0.004%, not 0.0%."""
    return f"{share:.1%}" if share >= 0.01 else f"{share * 100:.2g}%"


def kept_on_resume(record: dict[str, Any], step: int, epoch: int) -> bool:
    """Whether a metrics.jsonl record stays when a run resumes at ``step`` inside (or at the
    start of) ``epoch``: records up to the snapshot's step, except the resumed epoch's own
    record, which its end logs again. That record can share the snapshot's step: a snapshot
    taken at a stream's last step, before the stream said it was over (a stream's end is only
    known at the next fetch), or a 0.2 snapshot at an epoch's last step; and a partial record
    (the epoch --max-steps ended) goes, as the epoch goes on now."""
    if record.get("step", 0) > step or record.get("partial") or record.get("kind") == "goodput":
        return False  # (goodput: the run's end counts it again, over every attempt)
    return not (record.get("kind") == "epoch" and record.get("epoch") == epoch)


# Seconds a finished run waits for its trackers to take the last records and close (a server that
# hangs must not hold the job: what a tracker missed, `report --sync` sends later).
TRACKER_WAIT_S = 10.0


class Reporter:
    """Rank 0's reporting: console lines, progress bar, metrics.jsonl, the trackers, the summary."""

    def __init__(self, observe: ObservationSettings, run_dir: Path, uploads: Any = None,
                 step_figures: tuple[str, ...] = ()) -> None:
        """``uploads``: a run dir on a store (``run_dir`` its local mirror): its uploads.Uploader,
        which takes the run's files up too. ``step_figures``: the task's own, shown in step lines."""
        self.settings, self.run_dir, self.uploads = observe, Path(run_dir), uploads
        self.step_figures = step_figures
        self.bar: Any = None
        self.tracking: Tracking | None = None
        self.timeline = Timeline(self.run_dir)  # goodput.py: begun by rank 0's begin() alone

    def begin(self, settings: Mapping[str, Any], resumed_at: tuple[int, int] | None, world_size: int = 1,
              built: dict[str, Any] | None = None, unused: tuple[str, ...] = ()) -> None:
        """The run's ``settings`` as really used (config.json, with ``built``: the optimizer and schedule
        as built; ``unused``: settings null there, the optimizer's that the user left unset where the
        task built its own); on resume at ``(global step, epoch)``, forget metrics logged after the snapshot
        (those steps run again and log again). The attempt's timeline begins: what follows is
        training (goodput.py)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(config_json(settings, built, unused))
        kept: list[dict[str, Any]] = []
        if resumed_at is not None:
            kept = [r for r in read_metrics(self.run_dir) if kept_on_resume(r, *resumed_at)]
            (self.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.timeline.begin(resumed_at[0] if resumed_at else 0, world_size)
        self._upload("config.json", "metrics.jsonl", "timeline.jsonl")
        if self.settings.trackers():
            from .trackers import make_trackers

            self.tracking = Tracking(make_trackers(self.settings.trackers()), self.run_dir)
            recorded = json.loads((self.run_dir / "config.json").read_text())
            self.tracking.begin(recorded, kept)  # what a tracker lacks of them, first

    def catch_up(self) -> None:
        """A finished run found again (the same command): each tracker gets what it lacks of the
        run's records (a kill during the run's end, while the trackers finished, leaves them short)."""
        if not self.settings.trackers():
            return
        from .trackers import make_trackers

        tracking = Tracking(make_trackers(self.settings.trackers()), self.run_dir)
        tracking.begin(json.loads((self.run_dir / "config.json").read_text()), read_metrics(self.run_dir))
        tracking.end("finished", [self.run_dir / name for name in ("config.json", "curves.png")],
                     summarize(self.run_dir), wait_s=TRACKER_WAIT_S)
        sent = {lane.name: lane.delivery.sent for lane in tracking.lanes if lane.delivery.sent}
        if sent:
            self.info("ddptrain: the finished run's trackers lacked records (its end was cut short?); sent "
                      + ", ".join(f"{name} {count} value(s)" for name, count in sent.items()))
        self._upload("trackers.json", "metrics.csv")

    def info(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            say(message)

    # --- progress bar ------------------------------------------------------------------------
    def epoch_started(self, epoch: int, steps: int | None, done: int) -> None:
        """``steps``: the epoch's optimizer steps (None: a stream's, unknown)."""
        show = self.settings.progress if self.settings.progress is not None else sys.stderr.isatty()
        if not show:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=steps, initial=done, desc=f"epoch {epoch}", unit="step",
                        leave=False, dynamic_ncols=True, file=sys.stderr)

    def step_done(self, step: int, loss: Any = None) -> None:
        """Global step ``step`` is done; ``loss``: the one to show, when it is read."""
        self.timeline.step_done(step)
        if self.bar is None:
            return
        self.bar.update(1)
        if loss is not None:  # read only every few steps: a read synchronises with the device
            self.bar.set_postfix(loss=f"{float(loss):.4g}", refresh=False)

    def epoch_finished(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    # --- records -------------------------------------------------------------------------------
    def log_step(self, record: dict[str, Any]) -> None:
        """A step record (--log-every): metrics.jsonl, the trackers, and the console's line where
        no progress bar shows the loss."""
        self._record(record)
        if self.bar is None:
            self.info(console_line(record, self.step_figures))
        else:
            self.bar.set_postfix(loss=f"{record['train_loss']:.4g}", refresh=False)

    def log(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl, a console line, and the trackers' copies (queued)."""
        if record.get("straggler_wait_s"):
            self.timeline.straggled(record["straggler_wait_s"], record["step"])
        self._record(record)
        self.info(console_line(record))

    def _record(self, record: dict[str, Any]) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.tracking is not None:
            self.tracking.log(record)
        self._upload("metrics.jsonl", "trackers.json", "metrics.csv", "timeline.jsonl")

    def waited(self, seconds: float) -> None:
        """The next step waited ``seconds`` on others (torchft's quorum): goodput's waiting."""
        self.timeline.waited(seconds)

    def timed(self, kind: str, step: int) -> Any:
        """A context: a snapshot's (``"snapshot"``) or an evaluation's (``"eval"``) blocking time
        after ``step``, in the timeline."""
        return self.timeline.activity(kind, step)

    def _upload(self, *names: str) -> None:
        """A run dir on a store: these files go up behind the training (each a whole object)."""
        if self.uploads is not None:
            for name in names:
                if (self.run_dir / name).is_file():
                    self.uploads.add_file(name)

    def finish(self, step: int) -> None:
        """The run ended at global step ``step``: its goodput over every attempt (metrics.jsonl,
        the trackers), the summary, the curves, the trackers closed."""
        self.timeline.end("finished")
        figures = goodput_figures(self.run_dir)
        if figures:
            self._record({"kind": "goodput", "step": step, **figures})
        summary = summarize(self.run_dir)
        self.info(format_summary(summary))
        if self.settings.plot:
            self.info(plot_curves(self.run_dir) or f"curves: {self.run_dir / 'curves.png'}")
        self.close("finished", summary)

    def closed(self) -> None:
        """The run's end is over (trackers closed, uploads done): its last timeline line."""
        self.timeline.closed()

    def close(self, status: str, summary: dict[str, Any] | None = None) -> None:
        """Close the trackers' runs (``status``: finished, stopped, failed), once."""
        self.timeline.end(status)
        if self.tracking is not None:
            tracking, self.tracking = self.tracking, None
            files = [self.run_dir / name for name in ("config.json", "curves.png")]
            tracking.end(status, files if status == "finished" else [], summary,
                         wait_s=TRACKER_WAIT_S if status == "finished" else 5.0)
        if status != "failed":  # (a failure may be the store's: do not raise another one over it)
            self._upload("curves.png", "trackers.json", "metrics.csv")


class NullReporter(Reporter):
    """Every rank but 0: reports nothing."""

    def __init__(self, observe: ObservationSettings, run_dir: Path) -> None:
        super().__init__(observe, run_dir)

    def begin(self, settings: Mapping[str, Any], resumed_at: tuple[int, int] | None, world_size: int = 1,
              built: dict[str, Any] | None = None, unused: tuple[str, ...] = ()) -> None:
        pass

    def info(self, message: str) -> None:
        pass

    def epoch_started(self, epoch: int, steps: int | None, done: int) -> None:
        pass

    def log(self, record: dict[str, Any]) -> None:
        pass

    def log_step(self, record: dict[str, Any]) -> None:
        pass

    def finish(self, step: int) -> None:
        pass

    def catch_up(self) -> None:
        pass

    def close(self, status: str, summary: dict[str, Any] | None = None) -> None:
        pass

    def closed(self) -> None:
        pass


EVALUATED = ("eval_", "ema_eval_")  # an evaluation's figures: of the weights, and of --ema's average


def console_line(record: dict[str, Any], figures: tuple[str, ...] = ()) -> str:
    """``epoch 3 | step 128 | train_loss 1.962 | lr 0.001 | 13,930 samples/s | 0.15 s``; a step
    record's (--log-every) leads with its step: ``step 130 | epoch 4 | train_loss 1.95 | ...``,
    with the task's own ``figures`` after the gradient norm."""
    first = "before training" if record.get("kind") == "eval" and not record["step"] else f"epoch {record['epoch']}"
    if record.get("partial"):
        first += f" (partial: {record.get('ended_by', '--max-steps')})"
    parts = [f"step {record['step']}", first] if record.get("kind") == "step" else [first, f"step {record['step']}"]
    shown = ("train_loss", "lr", "grad_norm", *figures, *(f"{name}_rank" for name in figures)) \
        if record.get("kind") == "step" else ("train_loss", "lr")
    for key, value in record.items():
        if key in shown or (key.startswith(EVALUATED) and not key.endswith("eval_samples")):
            parts.append(f"{key} {_fmt(value)}")
    if record.get("evaluated_on"):  # --eval-batches: not the whole set
        parts.append(record["evaluated_on"])
    if record.get("samples_per_s"):
        parts.append(f"{record['samples_per_s']:,.0f} samples/s")
    if record.get("tokens_per_s"):
        parts.append(f"{record['tokens_per_s']:,.0f} tokens/s")
    if record.get("tflops"):
        mfu = f" (MFU {_percent(record['mfu'])})" if "mfu" in record else ""
        parts.append(f"{record['tflops']:.3g} TFLOP/s{mfu}")
    if "epoch_time_s" in record:
        parts.append(f"{record['epoch_time_s']:.2f} s")
    return " | ".join(parts)


SUMMARY_NOTES = {"train_loss": "the last epoch's mean"}  # what a figure is, where its name alone misleads


def format_summary(summary: dict[str, Any]) -> str:
    width = max((len(k) for k in summary), default=0)
    lines = ["summary"] + [f"  {k.ljust(width)}  {_fmt(v)}" + (f" ({SUMMARY_NOTES[k]})" if k in SUMMARY_NOTES else "")
                           for k, v in summary.items()]
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


def config_json(settings: Mapping[str, Any], built: dict[str, Any] | None, unused: tuple[str, ...] = ()) -> str:
    """config.json: the settings as used (RunConfig.settings(), flat), and ``built``, the optimizer and
    schedule as built (its class and every parameter group's hyper-parameters). ``unused``: settings
    written as null rather than their defaults (the optimizer's, where the task built its own)."""
    settings = {**settings, **dict.fromkeys(unused)}
    if built is not None:
        settings[BUILT] = built
    return json.dumps(settings, indent=2, sort_keys=True) + "\n"


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
