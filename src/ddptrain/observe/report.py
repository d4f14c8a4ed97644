"""What a run tells people as it goes: rank 0's console lines, progress bar, metrics.jsonl,
the experiment trackers (tracking.py), and at its end the summary and the curves plot (read
back from its records: summary.py). Other ranks get a Reporter that does nothing.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..console import say
from ..settings import BUILT, ObservationSettings
from .goodput import Timeline, goodput_figures
from .summary import EVALUATED, format_percent, format_summary, format_value, plot_curves, read_metrics, summarize
from .tracking import Tracking


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
            parts.append(f"{key} {format_value(value)}")
    if record.get("evaluated_on"):  # --eval-batches: not the whole set
        parts.append(record["evaluated_on"])
    if record.get("samples_per_s"):
        parts.append(f"{record['samples_per_s']:,.0f} samples/s")
    if record.get("tokens_per_s"):
        parts.append(f"{record['tokens_per_s']:,.0f} tokens/s")
    if record.get("tflops"):
        mfu = f" (MFU {format_percent(record['mfu'])})" if "mfu" in record else ""
        parts.append(f"{record['tflops']:.3g} TFLOP/s{mfu}")
    if "epoch_time_s" in record:
        parts.append(f"{record['epoch_time_s']:.2f} s")
    return " | ".join(parts)


def config_json(settings: Mapping[str, Any], built: dict[str, Any] | None, unused: tuple[str, ...] = ()) -> str:
    """config.json: the settings as used (RunConfig.settings(), flat), and ``built``, the optimizer and
    schedule as built (its class and every parameter group's hyper-parameters). ``unused``: settings
    written as null rather than their defaults (the optimizer's, where the task built its own)."""
    settings = {**settings, **dict.fromkeys(unused)}
    if built is not None:
        settings[BUILT] = built
    return json.dumps(settings, indent=2, sort_keys=True) + "\n"
