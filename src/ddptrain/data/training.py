"""The training batches of a run: a stream's (``StreamBatches``) or a map-style set's
(``TrainBatches`` over a ``StepSampler``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

from ..comm import DistContext
from ..settings import TrainingSettings
from .batches import TrainBatches
from .sampling import StepSampler
from .streams import StreamBatches, is_stream


def training_batches(train_set: Dataset, training: TrainingSettings, ctx: DistContext,
                     collate_fn: Callable[..., Any] | None, group: Any) -> TrainBatches | StreamBatches:
    """``group``: the gloo group a stream's ranks agree on each step's count through (None: the default)."""
    if is_stream(train_set):
        return StreamBatches(train_set, ctx.rank, ctx.world_size, training.batch_size,  # type: ignore[arg-type]  # is_stream: an IterableDataset
                             training.grad_accum, ctx.device, training.workers, collate_fn, training.seed, group,
                             ctx.watchdog)
    sampler = StepSampler(len(train_set), ctx.world_size, ctx.rank,  # type: ignore[arg-type]  # map-style: it has a length
                          training.batch_size, training.grad_accum, training.seed)
    return TrainBatches(train_set, sampler, ctx.device, training.workers, collate_fn)
