"""Numbers that need every rank: the epoch's mean training loss and exact evaluation.

Training losses stay on the device and are summed there; reading them costs one
all-reduce per epoch instead of a host synchronisation per step.

Evaluation is exact: the evaluation set is cut into the same consecutive batches for any
world size, rank r evaluates batches r, r+W, ... (no padding, no duplicates), each batch's
sums go into its own row of a table, and one all-reduce assembles the table (every row has
exactly one non-zero contributor, and x + 0 is exact). Adding the rows in batch order then
gives bitwise the figures of a single-process evaluation.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate

from .data import eval_batch_ranges, eval_shard
from .tasks.protocol import LossFn, MetricFn


class RunningLoss:
    """Sum and count of per-step losses, kept on the device until read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=self.device)
        self.steps = 0

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss.detach()  # one in-place add, promoted to float64
        self.steps += 1

    def restore(self, total: float, steps: int) -> None:
        self.total.fill_(total)
        self.steps = steps

    def global_sums(self) -> tuple[float, int]:
        """(sum of losses, number of steps) over all ranks: one all-reduce."""
        both = torch.stack([self.total, torch.tensor(float(self.steps), dtype=torch.float64,
                                                      device=self.device)])
        if dist.is_initialized():
            dist.all_reduce(both)
        total, steps = both.tolist()
        return total, int(steps)

    def global_mean(self) -> float:
        """Mean over steps and ranks; NaN when no step ran."""
        total, steps = self.global_sums()
        return total / steps if steps else float("nan")


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Dataset, loss_fn: LossFn,
             metrics: Mapping[str, MetricFn], batch_size: int, device: torch.device,
             rank: int = 0, world_size: int = 1) -> dict[str, float]:
    """``{"loss": …, <metric>: …, "samples": n}`` over the whole set, exact for any world size."""
    names = ["loss", *metrics]
    ranges = eval_batch_ranges(len(dataset), batch_size)
    # Columns: one per figure, then the batch's sample count.
    table = torch.zeros(len(ranges), len(names) + 1, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    for batch_no in eval_shard(len(ranges), rank, world_size):
        inputs, target = (t.to(device) for t in default_collate([dataset[i] for i in ranges[batch_no]]))
        output = model(inputs)
        count = target.shape[0]
        sums = [loss_fn(output, target).double() * count]
        sums += [fn(output, target).double() for fn in metrics.values()]
        table[batch_no] = torch.stack([*sums, torch.tensor(float(count), dtype=torch.float64, device=device)])
    model.train(was_training)
    if world_size > 1:
        dist.all_reduce(table)
    totals = table.cpu().sum(dim=0).tolist()  # rows added in batch order on every rank
    samples = totals[-1]
    result = {name: total / samples for name, total in zip(names, totals)}
    result["samples"] = int(samples)
    return result
