"""Metric objects in Task.metrics (torchmetrics' F1 and AUROC, examples/digits_metrics.py):
each evaluation's figure is torchmetrics' own over exactly the evaluation set (and F1
sklearn's), on 1, 2 and 3 ranks and under fsdp, whose evaluation runs a padding batch that
must not be counted, whether ddptrain or eval_fn updates the objects."""

import sys

import pytest
import torch
from sklearn.metrics import f1_score  # (at import: it sets KMP_* variables, which a test would leak)

from ddptrain import ConfigError, RunConfig, Task
from ddptrain.tasks.digits import digits_task
from helpers.commands import REPO, fit, load_model, read_metrics

pytest.importorskip("torchmetrics", reason="the metrics extra (pip install 'ddptrain[metrics]') is not installed")
sys.path.insert(0, str(REPO / "examples"))  # the forked ranks import the example's task from here

from digits_metrics import digits_f1_auroc  # noqa: E402

pytestmark = pytest.mark.slow
TASK = "digits_metrics:digits_f1_auroc"


def _whole_set(weights: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """torchmetrics in this process over the whole evaluation set, in one batch."""
    from ddptrain.tasks import build

    task = build(RunConfig(task=TASK), digits_f1_auroc)  # seeded as the ranks build it
    if weights is not None:
        task.model.load_state_dict(weights)
    inputs, target = task.eval_set.tensors
    with torch.no_grad():
        output = task.model(inputs)
    return {name: float(metric(output, target)) for name, metric in task.metrics.items() if name in ("f1", "auroc")}


def _sklearn_f1() -> float:
    from ddptrain.tasks import build

    task = build(RunConfig(task=TASK), digits_f1_auroc)
    inputs, target = task.eval_set.tensors
    with torch.no_grad():
        predicted = task.model(inputs).argmax(dim=1)
    return float(f1_score(target.numpy(), predicted.numpy(), average="macro"))


def _figures(record: dict) -> dict[str, float]:
    return {"f1": record["eval_f1"], "auroc": record["eval_auroc"]}


def test_f1_and_auroc_are_the_whole_sets_on_any_world_size_and_strategy(tmp_path):
    initial = _whole_set()
    # --max-epochs 0 evaluates the initial model: the same weights everywhere. Batch 40: 9
    # evaluation batches of the 359 samples, 5 on rank 0 and 4 on rank 1 (+1 padding under fsdp).
    assert initial["f1"] == pytest.approx(_sklearn_f1(), rel=1e-6)
    for name, options in {"one": {"nproc": 1}, "ddp": {}, "three": {"nproc": 3}, "fsdp": {"strategy": "fsdp"}}.items():
        fit(TASK, tmp_path / name, max_epochs=0, batch_size=40, **options)
        (record,) = read_metrics(tmp_path / name)
        assert _figures(record) == pytest.approx(initial, rel=1e-6), name
        assert record["eval_samples"] == 359
    # eval_fn updates the F1 itself: under fsdp too, the padding batch adds nothing
    fit("metric_tasks:digits_f1_by_eval_fn", tmp_path / "by-eval-fn", strategy="fsdp", max_epochs=0, batch_size=40)
    (record,) = read_metrics(tmp_path / "by-eval-fn")
    assert record["eval_f1"] == pytest.approx(initial["f1"], rel=1e-6)
    fit(TASK, tmp_path / "trained", strategy="fsdp", max_epochs=1, batch_size=40)
    final = read_metrics(tmp_path / "trained")[-1]
    assert _figures(final) == pytest.approx(_whole_set(load_model(tmp_path / "trained")), rel=1e-6)
    assert _figures(final) != pytest.approx(initial, rel=1e-3)  # it trained: the figures moved


def test_a_sum_metric_with_eval_fn_or_an_object_of_several_values_is_one_line():
    from ddptrain.observe.evaluation import _one_figure
    from ddptrain.tasks.protocol import check_task

    task = digits_task(RunConfig())
    bad = Task(model=task.model, train_set=task.train_set, loss_fn=task.loss_fn,
               eval_fn=lambda model, batch: {"samples": 1}, metrics=task.metrics)
    with pytest.raises(ConfigError, match=r"Task.metrics\['accuracy'\] is a per-batch sum .* eval_fn replaces"):
        check_task(bad, "bad")
    with pytest.raises(ConfigError, match=r"computes 10 values; .* average='macro'"):
        _one_figure("f1", torch.zeros(10))
