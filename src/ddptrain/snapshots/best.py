"""The best model so far (``--keep-best METRIC[:min|max]``) and early stopping (``--early-stop N``).

Every evaluation is judged on every rank from the same figures (observe/evaluation.evaluate sums
every rank's rows in one all-reduce, in batch order), so every rank takes the same decision:
which evaluation is the best, and whether the run stops. No rank ever waits for another's vote.

- The best evaluation's weights are ``RUN_DIR/best/model.pt`` (a plain state_dict, as
  model.pt), written whole and atomically, then ``best/best.json`` (the metric, its value, the
  step and epoch). A run killed between the two writes replays that evaluation on resume (the
  snapshot holds the decision state, and the replay is exact), which writes both again.
- The decision state (the best value and step, evaluations since the last improvement) is part
  of every snapshot's ``progress`` table: a resume continues the count.
- An improvement for the best model is any strict one; for ``--early-stop`` it must beat the
  value at the last improvement by more than ``--early-stop-delta``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..settings import EvaluationSettings, watched_metric
from ..tasks.protocol import Task

BEST = "best"  # the folder in the run dir


class BestModel:
    """Judges each evaluation record; its state is part of the snapshot's progress table."""

    def __init__(self, spec: str, patience: int = 0, delta: float = 0.0) -> None:
        self.metric, self.mode = watched_metric(spec)
        self.patience, self.delta = patience, delta
        self.value: float | None = None  # the best value so far
        self.step = -1  # its global step
        self.reference: float | None = None  # the value an --early-stop improvement must beat by delta
        self.stale = 0  # evaluations since the last --early-stop improvement

    @property
    def stopped(self) -> bool:
        """--early-stop's patience has run out."""
        return self.patience > 0 and self.stale >= self.patience

    def _better(self, value: float, than: float | None, by: float = 0.0) -> bool:
        if than is None:
            return True
        return value < than - by if self.mode == "min" else value > than + by

    def judge(self, record: dict[str, Any]) -> bool:
        """Take one evaluation record into account; whether it is the best so far."""
        if self.metric not in record:
            figures = ", ".join(sorted(k for k in record if k.startswith("eval_") and k != "eval_samples"))
            raise ConfigError(f"--keep-best {self.metric}: the evaluation has no such figure; it has {figures}")
        value = float(record[self.metric])
        if not math.isfinite(value):
            improved = False
        else:
            improved = self._better(value, self.value)
            if improved:
                self.value, self.step = value, int(record["step"])
        if math.isfinite(value) and self._better(value, self.reference, self.delta):
            self.reference, self.stale = value, 0
        else:
            self.stale += 1
        return improved

    def stop_line(self, step: int) -> str:
        """The line that says the run stopped at ``step``, and which evaluation was the best."""
        return (f"stopped early at step {step}: {self.stale} evaluation(s) in a row without an improvement of "
                f"more than {self.delta:g} (--early-stop {self.patience}); the best {self.metric} "
                f"{self.value:.6g} was at step {self.step}")

    # --- in the snapshot's progress table ----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.value, "best_step": self.step, "best_reference": self.reference,
                "evals_without_improvement": self.stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.step = state.get("best_value"), int(state.get("best_step", -1))
        self.reference, self.stale = state.get("best_reference"), int(state.get("evals_without_improvement", 0))


def best_model(evaluation: EvaluationSettings, task: Task, task_name: str) -> BestModel | None:
    """The run's BestModel, or None without ``--keep-best``. Checked before anything is trained:
    an evaluation set, and, for tutorial-shaped tasks (whose figures are the loss and
    ``Task.metrics``), the figure itself (an ``eval_fn``'s are known only once it has run)."""
    if not evaluation.keep_best.strip():
        return None
    if task.eval_set is None:
        raise ConfigError(f"--keep-best {evaluation.keep_best} needs an evaluation set, and the task {task_name} has "
                          "none (Task.eval_set)")
    best = BestModel(evaluation.keep_best, evaluation.early_stop, evaluation.early_stop_delta)
    figures = sorted(f"eval_{name}" for name in ("loss", *task.metrics))
    if task.eval_fn is None and best.metric not in figures:
        raise ConfigError(f"--keep-best {best.metric}: the evaluation has no such figure; it has {', '.join(figures)}")
    return best


def write_best(weights: dict[str, Any], run_dir: Path, best: BestModel, epoch: int) -> list[str]:
    """``best/model.pt``, then ``best/best.json`` (rank 0); the run dir's names written."""
    from .files import atomic_save

    folder = Path(run_dir) / BEST
    folder.mkdir(parents=True, exist_ok=True)
    atomic_save(weights, folder / "model.pt")
    record = {"metric": best.metric, "mode": best.mode, "value": best.value, "step": best.step, "epoch": epoch}
    tmp = folder / f".best.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, folder / "best.json")
    return [f"{BEST}/model.pt", f"{BEST}/best.json"]
