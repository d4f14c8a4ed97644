"""Metrics that are no sums, exact on any number of ranks: F1 and AUROC from torchmetrics on
the built-in digits task.

    pip install torchmetrics
    ddptrain train --task digits_metrics:digits_f1_auroc --max-epochs 3   (from this folder)

A torchmetrics Metric in ``Task.metrics`` is reset before each evaluation, updated with every
evaluation batch's ``(model(inputs), target)`` (never with the padding batches a sharded
evaluation runs so every rank runs as many forwards), and computed once over the whole
evaluation set: torchmetrics gathers its state from every rank. metrics.jsonl then holds
``eval_f1`` and ``eval_auroc`` beside ``eval_loss``; ``--keep-best eval_f1`` keeps the best.
"""

from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

from ddptrain import RunConfig, Task
from ddptrain.tasks.digits import digits_task


def digits_f1_auroc(cfg: RunConfig) -> Task:
    task = digits_task(cfg)
    task.metrics = {**task.metrics,  # digits' own accuracy: a sum per batch
                    "f1": MulticlassF1Score(num_classes=10, average="macro"),
                    "auroc": MulticlassAUROC(num_classes=10)}
    return task
