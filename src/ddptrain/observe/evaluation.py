"""The evaluation loop, exact on any world size.

The evaluation set is cut into the same consecutive batches for any world size, rank r
evaluates batches r, r+W, ... (no padding, no duplicates), each batch's sums go into its own
row of a table, and one all-reduce assembles the table (every row has exactly one non-zero
contributor, and x + 0 is exact). Adding the rows in batch order then gives bitwise the
figures of a single-process evaluation.

A metric object in ``Task.metrics`` (torchmetrics' ``Metric``, or anything with its
``update`` / ``compute`` / ``reset``) is reset before each evaluation, updated with every
counted batch, never a padding batch (with ``(output, target)`` by ddptrain, or as ``eval_fn``
updates it: its ``update`` does nothing during a padding batch), and computed once at the end,
where the object synchronises its own state over the ranks (torchmetrics gathers it from
every rank of the default group): figures such as F1 or AUROC, which are no sums, come out
of exactly the evaluation set on every world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..comm import CollectiveMarks, broadcast_object
from ..data import EvalBatches
from ..errors import ConfigError
from ..tasks.protocol import Task, check_pair, is_metric_object

NO_MARKS = CollectiveMarks()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: EvalBatches, task: Task, autocast: Any = None,
             rank: int = 0, world_size: int = 1, watchdog: CollectiveMarks = NO_MARKS,
             forward_syncs: bool = False, counts: bool = True) -> dict[str, float]:
    """``{"loss": …, <metric>: …, "samples": n}`` over the whole set, exact for any world size.
    ``forward_syncs``: the model's forward holds a collective (sharded): marked for the
    watchdog, and the model's forward pre-hook marks its end (see Trainer). ``counts``: this
    rank's sums count (--tp: a tensor-parallel group's ranks evaluate the same batches, and the
    first one's count)."""
    rows: dict[int, dict[str, torch.Tensor]] = {}
    objects = metric_objects(task)
    for metric in objects.values():
        metric.reset()
        metric.to(batches.device)
    was_training = model.training
    model.eval()
    for batch_no, batch in batches:
        if forward_syncs:  # ends in the model's forward pre-hook (see Trainer)
            watchdog.arrive("an evaluation forward (FSDP's parameter all-gather)")
        with autocast or contextlib.nullcontext():
            sums = _batch_sums(model, batch, task, counted=batch_no >= 0)
        if batch_no >= 0:  # -1: a padding batch (data.EvalBatches), run but not counted
            rows[batch_no] = sums
    model.train(was_training)
    names = _column_names(rows, task, world_size)
    device = batches.device
    table = torch.zeros(batches.num_batches, len(names) + 1, dtype=torch.float64, device=device)
    for batch_no, sums in rows.items():
        _check_names(sums, names)
        table[batch_no] = torch.stack([torch.as_tensor(sums[n], device=device).double() for n in [*names, "samples"]])
    if not counts:
        table.zero_()
    if world_size > 1:
        with watchdog.waiting("evaluation: sum of every rank's figures"):
            dist.all_reduce(table)
    totals = table.cpu().sum(dim=0).tolist()  # rows added in batch order on every rank
    samples = totals[-1]
    result = {name: total / samples for name, total in zip(names, totals)}
    if objects:
        with watchdog.waiting("evaluation: the metric objects' sync over the ranks"):
            result.update({name: _one_figure(name, metric.compute()) for name, metric in objects.items()})
    result["samples"] = int(samples)
    return result


def metric_objects(task: Task) -> dict[str, Any]:
    """``Task.metrics``' metric objects (torchmetrics' Metric, or anything with its update /
    compute / reset and ``to``), in the same order on every rank."""
    return {name: metric for name, metric in task.metrics.items() if is_metric_object(metric)}


@contextlib.contextmanager
def _updates_suspended(objects: dict[str, Any]) -> Iterator[None]:
    """A padding batch: eval_fn may update the metric objects, which take nothing from it
    (their ``update`` does nothing meanwhile; torchmetrics' forward goes through it too)."""
    own = {name: metric.__dict__.get("update") for name, metric in objects.items()}
    for metric in objects.values():
        metric.update = _ignore
    try:
        yield
    finally:
        for name, metric in objects.items():
            if own[name] is None:  # the class's own method: uncovered again
                del metric.update
            else:
                metric.update = own[name]


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _one_figure(name: str, value: Any) -> float:
    tensor = torch.as_tensor(value)
    if tensor.numel() != 1:
        raise ConfigError(f"Task.metrics[{name!r}] computes {tensor.numel()} values; ddptrain logs one number "
                          "per figure: make it one (torchmetrics: average='macro', say)")
    return float(tensor)


def _batch_sums(model: torch.nn.Module, batch: Any, task: Task, counted: bool = True) -> dict[str, Any]:
    """The batch's sums; ``counted`` (not a padding batch): the metric objects take it too
    (from (output, target) here, or from eval_fn's own updates)."""
    if task.eval_fn is not None:
        with contextlib.nullcontext() if counted else _updates_suspended(metric_objects(task)):
            sums = task.eval_fn(model, batch)
        if not isinstance(sums, Mapping) or "samples" not in sums:
            raise ConfigError("Task.eval_fn must return a dict of per-batch sums with the batch's sample "
                              "count under 'samples', e.g. {'loss': loss_sum, 'samples': n}")
        return dict(sums)
    check_pair(batch)
    inputs, target = batch
    output = model(inputs)
    count = target.shape[0]
    sums = {"loss": task.loss_fn(output, target).double() * count}  # type: ignore[misc]  # loss_fn is set when step_fn is not (check_task)
    objects = metric_objects(task)
    sums.update({name: fn(output, target) for name, fn in task.metrics.items() if name not in objects})
    for metric in objects.values() if counted else ():
        metric.update(output, target)
    sums["samples"] = count
    return sums


def _column_names(rows: dict[int, dict[str, Any]], task: Task, world_size: int) -> list[str]:
    if task.eval_fn is None:
        return ["loss", *[name for name in task.metrics if name not in metric_objects(task)]]
    # eval_fn names its own figures; rank 0 always holds batch 0, and every rank's table
    # must have the same columns, so rank 0's names are the job's.
    names = sorted(k for k in rows.get(0, {}) if k != "samples")
    return broadcast_object(names) if world_size > 1 else names


def _check_names(sums: Mapping[str, Any], names: list[str]) -> None:
    if sorted(k for k in sums if k != "samples") != sorted(names):
        raise ConfigError(f"Task.eval_fn returned figures {sorted(sums)} for one batch and {names} "
                          "for another; return the same names for every batch")
