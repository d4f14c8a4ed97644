"""The evaluation loop, exact on any world size.

The evaluation set is cut into the same consecutive batches for any world size, rank r
evaluates batches r, r+W, ... (no padding, no duplicates), each batch's sums go into its own
row of a table, and one all-reduce assembles the table (every row has exactly one non-zero
contributor, and x + 0 is exact). Adding the rows in batch order then gives bitwise the
figures of a single-process evaluation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..comm import CollectiveMarks, broadcast_object
from ..data import EvalBatches
from ..errors import ConfigError
from ..tasks.protocol import Task, check_pair

NO_MARKS = CollectiveMarks()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: EvalBatches, task: Task, autocast: Any = None,
             rank: int = 0, world_size: int = 1, watchdog: CollectiveMarks = NO_MARKS,
             forward_syncs: bool = False) -> dict[str, float]:
    """``{"loss": …, <metric>: …, "samples": n}`` over the whole set, exact for any world size.
    ``forward_syncs``: the model's forward holds a collective (sharded): marked for the
    watchdog, and the model's forward pre-hook marks its end (see Trainer)."""
    rows: dict[int, dict[str, torch.Tensor]] = {}
    was_training = model.training
    model.eval()
    for batch_no, batch in batches:
        if forward_syncs:  # ends in the model's forward pre-hook (see Trainer)
            watchdog.arrive("an evaluation forward (FSDP's parameter all-gather)")
        with autocast or contextlib.nullcontext():
            sums = _batch_sums(model, batch, task)
        if batch_no >= 0:  # -1: a padding batch (data.EvalBatches), run but not counted
            rows[batch_no] = sums
    model.train(was_training)
    names = _column_names(rows, task, world_size)
    device = batches.device
    table = torch.zeros(batches.num_batches, len(names) + 1, dtype=torch.float64, device=device)
    for batch_no, sums in rows.items():
        _check_names(sums, names)
        table[batch_no] = torch.stack([torch.as_tensor(sums[n], device=device).double() for n in [*names, "samples"]])
    if world_size > 1:
        with watchdog.waiting("evaluation: sum of every rank's figures"):
            dist.all_reduce(table)
    totals = table.cpu().sum(dim=0).tolist()  # rows added in batch order on every rank
    samples = totals[-1]
    result = {name: total / samples for name, total in zip(names, totals)}
    result["samples"] = int(samples)
    return result


def _batch_sums(model: torch.nn.Module, batch: Any, task: Task) -> dict[str, Any]:
    if task.eval_fn is not None:
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
    sums.update({name: fn(output, target) for name, fn in task.metrics.items()})
    sums["samples"] = count
    return sums


def _column_names(rows: dict[int, dict[str, Any]], task: Task, world_size: int) -> list[str]:
    if task.eval_fn is None:
        return ["loss", *task.metrics]
    # eval_fn names its own figures; rank 0 always holds batch 0, and every rank's table
    # must have the same columns, so rank 0's names are the job's.
    names = sorted(k for k in rows.get(0, {}) if k != "samples")
    return broadcast_object(names) if world_size > 1 else names


def _check_names(sums: Mapping[str, Any], names: list[str]) -> None:
    if sorted(k for k in sums if k != "samples") != sorted(names):
        raise ConfigError(f"Task.eval_fn returned figures {sorted(sums)} for one batch and {names} "
                          "for another; return the same names for every batch")
