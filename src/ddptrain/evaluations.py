"""The held-out set's evaluations during a run: the weights' figures, the average's beside them
(--ema), the newest kept for the epoch's record, and each judged for --keep-best (a new best's
weights go to best/). The Trainer (trainer.py) decides when; this module runs and judges them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .comm import DistContext
from .data import EvalBatches
from .observe.evaluation import evaluate
from .parallel.averaging import WeightAverage
from .parallel.base import Strategy
from .snapshots.best import BestModel, write_best
from .snapshots.uploads import Uploader
from .tasks.protocol import Task


class Evaluations:
    """``batches``: the evaluation set's (None: the task has none, and an evaluation is empty), or
    --eval-batches' subset of it (``subset``), with ``whole``, which makes the whole set's for the
    run's final evaluation (None: the final one reads ``batches`` too).
    ``share_buffers``: makes every rank's buffers rank 0's, so all evaluate what model.pt holds."""

    def __init__(self, *, task: Task, ctx: DistContext, strategy: Strategy, module: torch.nn.Module,
                 model: torch.nn.Module, average: WeightAverage | None, batches: EvalBatches | None,
                 best: BestModel | None, run_dir: Path, uploads: Uploader | None,
                 share_buffers: Callable[[], None], subset: bool = False,
                 whole: Callable[[], EvalBatches] | None = None) -> None:
        self.task, self.ctx, self.strategy, self.module, self.model = task, ctx, strategy, module, model
        self.average, self.batches, self.best, self.run_dir, self.uploads = average, batches, best, run_dir, uploads
        self.share_buffers, self.subset, self.whole = share_buffers, subset, whole
        # the newest evaluation's (global step, over the whole set), and its figures:
        self.evaluated_at: tuple[int, bool] = (-1, False)
        self.newest: dict[str, Any] = {}

    def add_to(self, record: dict[str, Any], final: bool = False) -> None:
        """The figures of the evaluation at the record's step into ``record`` (an epoch's, or an
        evaluation's own), run and judged, unless that step's evaluation already ran (and was
        judged). ``final``: the run's last, over the whole set where --eval-batches reads a subset."""
        whole = final and self.whole is not None
        if self.evaluated_at == (record["step"], whole):
            record.update(self.newest)
            return
        record.update(self._run(record["step"], whole))
        self._judge(record)

    def _run(self, step: int, whole: bool) -> dict[str, Any]:
        """``eval_<name>`` for the weights' figures and ``ema_eval_<name>`` for the average's (every rank calls it)."""
        if self.batches is None:
            return {}
        self.evaluated_at = (step, whole)
        self.share_buffers()
        model = self.strategy.eval_model(self.module, self.model)
        if whole and self.whole is not None:  # made at the first use: its loader's workers start then
            self.batches, self.whole, self.subset = self.whole(), None, False
        batches = self.batches

        def figures() -> dict[str, float]:
            return evaluate(model, batches, self.task, self.strategy.autocast(), self.ctx.rank, self.ctx.world_size,
                            self.ctx.watchdog, forward_syncs=self.strategy.forward_syncs,
                            counts=self.strategy.counts_data)

        self.newest = {f"eval_{k}": v for k, v in figures().items()}
        if self.average is not None:  # the average's figures beside the weights'
            with self.average.swapped_in(lambda: self.strategy.settle(self.module)):
                averaged = figures()
            self.newest.update({f"ema_eval_{k}": v for k, v in averaged.items() if k != "samples"})
        if self.subset:  # (said in the record, the console's line and the summary)
            self.newest["evaluated_on"] = "--eval-batches subset"
        return dict(self.newest)

    def _judge(self, record: dict[str, Any]) -> None:
        """--keep-best: every rank judges the same record (its figures, step and epoch); a new
        best's weights go to best/ (under fsdp every rank helps gather them)."""
        if self.best is None or not self.best.judge(record):
            return
        weights = self.strategy.full_model_state(self.module)
        if weights is not None:
            written = write_best(weights, self.run_dir, self.best, record["epoch"])
            if self.uploads is not None:
                for name in written:
                    self.uploads.add_file(name)
