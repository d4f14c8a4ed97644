"""The task protocol: what a task factory returns. docs/api.md is the reference."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from ..errors import ConfigError

# Tutorial-shaped batches ``(inputs, target)``: the loss of one batch, and metrics that each
# return the *sum* of a per-sample figure over the batch (e.g. the number of correct
# predictions). ddptrain adds the sums of every rank and divides by the number of samples,
# so distributed evaluation equals single-process evaluation. A metric may also be a metric
# object (torchmetrics' Metric: update / compute / reset), computed over the whole set
# (observe/evaluation.py).
LossFn = Callable[[Any, Any], torch.Tensor]
MetricFn = Callable[[Any, Any], torch.Tensor]
# Batches of any structure: the scalar loss of one batch (called inside autocast), and the
# evaluation sums of one batch, with the batch's sample count under "samples".
StepFn = Callable[[torch.nn.Module, Any], torch.Tensor]
EvalFn = Callable[[torch.nn.Module, Any], Mapping[str, Any]]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer, int], Any]


def _about(help: str, **kw: Any) -> Any:
    """A Task field with its line of help (the API reference's table of Task's fields)."""
    return field(metadata={"help": help}, **kw)


@dataclass
class Task:
    """Everything a run trains. Every rank calls the factory: build it the same way on every
    rank (from ``cfg.seed``), so all hold the same data and the same initial weights. Give
    ``loss_fn`` for tutorial-shaped ``(inputs, target)`` batches, or ``step_fn`` for any other."""

    model: torch.nn.Module = _about("the model, as built on every rank (the same initial weights: seed it from "
                                    "cfg.seed); ddptrain wraps it (DDP, FSDP2) and writes its weights to model.pt")
    train_set: Dataset = _about("the training data: a map-style Dataset (each rank samples its share of every "
                                "step's global batch) or an IterableDataset (a stream: each rank reads its own)")
    loss_fn: LossFn | None = _about("loss_fn(output, target): the mean loss of one (inputs, target) batch "
                                    "(called inside autocast)", default=None)
    eval_set: Dataset | None = _about("the held-out data: a map-style Dataset, evaluated over every rank "
                                      "(None: no evaluation)", default=None)
    metrics: dict[str, MetricFn] = _about("evaluation figures by name: metric(output, target) returning the SUM of "
                                          "a per-sample figure over the batch (e.g. correct predictions), or a "
                                          "torchmetrics metric object", default_factory=dict)
    make_optimizer: OptimizerFactory | None = _about("make_optimizer(params) -> Optimizer, in place of --optimizer, "
                                                     "--momentum, --weight-decay, --betas and --eps", default=None)
    make_scheduler: SchedulerFactory | None = _about(
        "make_scheduler(optimizer, total_steps) -> an LRScheduler stepped once per optimizer step, in place of "
        "--lr-schedule, --warmup-steps and --min-lr", default=None)
    defaults: dict[str, Any] = _about("defaults for the settings the user left unset: lr, optimizer, momentum, "
                                      "weight_decay (config.GLOBAL_DEFAULTS' keys)", default_factory=dict)
    collate_fn: Callable[[list[Any]], Any] | None = _about(
        "the DataLoader's collate_fn: batches of any structure (dicts, nested tuples; Hugging Face style)",
        default=None)
    step_fn: StepFn | None = _about("step_fn(model, batch) -> the scalar loss of a batch of any structure (or "
                                    "(loss_sum, count)), in place of loss_fn", default=None)
    eval_fn: EvalFn | None = _about("eval_fn(model, batch) -> {figure: sum over the batch, 'samples': count}: "
                                    "the evaluation of batches of any structure", default=None)
    blocks: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = _about(
        "blocks(model) -> the submodules that --strategy fsdp shards and --activation-checkpointing recomputes "
        "one by one (default: the members of the model's largest ModuleList or Sequential)", default=None)
    tokens_per_sample: int | None = _about("tokens in one sample (a language model's sequence length): tokens/s "
                                           "in the records", default=None)
    tp_plan: dict[str, str] | None = _about(
        "--tp: the layers a tensor-parallel group splits, {module-name pattern: 'colwise' | 'rowwise'} (fnmatch "
        "patterns such as 'blocks.*.attn.q'; torchtitan's and Hugging Face's tp plans name them so): a colwise "
        "Linear splits its output features, a rowwise one its input features and sums its output; the modules "
        "between them must work on their share (attention on its share of the heads); also Hugging Face's "
        "'colwise_gather_output' (an LM head whose logits are gathered whole) and 'embedding_rowwise' (an "
        "Embedding split by vocabulary). None: a Hugging Face model's own tp_plan, when it has one", default=None)
    step_figures: dict[str, str] = _about(
        "figures step_fn returns beside its loss, {name: 'mean' | 'sum' | 'max'}: step_fn then returns {'loss': "
        "loss, name: value, ...}, and each step record holds the value combined over the ranks and the record's "
        "steps as declared (max: with the rank that had it, as name_rank); no collective of their own",
        default_factory=dict)


TaskFactory = Callable[[Any], Task]


def is_metric_object(metric: Any) -> bool:
    """A torchmetrics Metric, or anything with its update / compute / reset and ``to``."""
    return all(callable(getattr(metric, method, None)) for method in ("update", "compute", "reset", "to"))


def check_task(task: Any, name: str) -> None:
    """ConfigError (one line, naming the field) for a Task that cannot be trained."""
    if not isinstance(task, Task):
        raise ConfigError(f"--task {name}: the factory returned {type(task).__name__}, not a ddptrain.Task")
    if not isinstance(task.model, torch.nn.Module):
        raise ConfigError(f"--task {name}: Task.model is {type(task.model).__name__}, not a torch.nn.Module")
    if (task.loss_fn is None) == (task.step_fn is None):
        which = "both loss_fn and step_fn" if task.loss_fn is not None else "neither loss_fn nor step_fn"
        raise ConfigError(f"--task {name}: Task has {which}; give exactly one "
                          "(loss_fn for (inputs, target) batches, step_fn(model, batch) for any other)")
    sums = [key for key, metric in task.metrics.items() if not is_metric_object(metric)]
    if (task.step_fn is not None or task.eval_fn is not None) and sums:
        raise ConfigError(f"--task {name}: Task.metrics[{sums[0]!r}] is a per-batch sum of (output, target), which "
                          "eval_fn replaces; report it from eval_fn(model, batch), or make it a metric object "
                          "(torchmetrics) that eval_fn updates")
    check_step_figures(task.step_figures, name)
    if task.step_figures and task.step_fn is None:
        raise ConfigError(f"--task {name}: Task.step_figures are returned by step_fn, which this task does not "
                          "have; give step_fn(model, batch) -> {'loss': loss, figure: value}, or drop step_figures")
    for name_, value in (("collate_fn", task.collate_fn), ("step_fn", task.step_fn),
                         ("eval_fn", task.eval_fn), ("loss_fn", task.loss_fn), ("blocks", task.blocks),
                         ("make_optimizer", task.make_optimizer), ("make_scheduler", task.make_scheduler)):
        if value is not None and not callable(value):
            raise ConfigError(f"--task {name}: Task.{name_} is {type(value).__name__}, not a function")
    if not isinstance(task.train_set, IterableDataset):  # map-style: every rank samples its own share
        try:
            len(task.train_set)  # type: ignore[arg-type]  # probing for a length: a TypeError is the answer
        except TypeError:
            raise ConfigError(f"--task {name}: Task.train_set has no len(); give a map-style data set "
                              "(torch.utils.data.Dataset with __len__ and __getitem__) or an IterableDataset "
                              "(see docs/data.md)") from None
        if len(task.train_set) == 0:  # type: ignore[arg-type]  # map-style: checked above
            raise ConfigError(f"--task {name}: Task.train_set is empty")
    if task.eval_set is not None:
        if isinstance(task.eval_set, IterableDataset) or not hasattr(task.eval_set, "__len__"):
            raise ConfigError(f"--task {name}: Task.eval_set must be a map-style data set (__len__ and "
                              "__getitem__), so that every rank evaluates its own batches")
        if len(task.eval_set) == 0:
            raise ConfigError(f"--task {name}: Task.eval_set is empty; give it samples, or leave it None "
                              "to train without evaluation")


# A step record's own keys: a task's figure may not take one.
RECORD_KEYS = ("loss", "count", "kind", "epoch", "step", "train_loss", "grad_norm", "lr", "samples_per_s",
               "tokens_per_s", "tflops", "mfu", "time")
COMBINES = ("mean", "sum", "max")  # how a task's step figure is combined over the ranks and steps


def check_step_figures(figures: Any, name: str) -> None:
    """ConfigError (one line) unless Task.step_figures is {name: 'mean' | 'sum' | 'max'} with names of its own."""
    if not isinstance(figures, Mapping):
        raise ConfigError(f"--task {name}: Task.step_figures is a {type(figures).__name__}; give a dict such as "
                          "{'aux_loss': 'mean'}")
    for figure, combine in figures.items():
        if not (isinstance(figure, str) and re.fullmatch(r"[A-Za-z_][\w.]*", figure)) or figure in RECORD_KEYS \
                or figure.endswith("_rank"):
            raise ConfigError(f"--task {name}: Task.step_figures names {figure!r}; give a name of letters, digits "
                              f"and _ that is none of the record's own ({', '.join(RECORD_KEYS)}) and does not end "
                              "in _rank")
        if combine not in COMBINES:
            raise ConfigError(f"--task {name}: Task.step_figures[{figure!r}] is {combine!r}; choose how the ranks "
                              f"and steps combine it: {', '.join(COMBINES)}")


def split_figures(value: Any, declared: Mapping[str, str], check: bool = False) -> tuple[Any, dict[str, Any]]:
    """step_fn's value without its figures (the loss, or (loss_sum, count)), and its figures: a
    mapping ``{"loss": ..., ["count": ...,] figure: value, ...}`` splits so; anything else has none.
    ConfigError (one line) for a mapping without "loss" or with a figure not declared; ``check``
    (the first step): also for a figure that is not one number."""
    if not isinstance(value, Mapping):
        return value, {}
    if "loss" not in value:
        raise ConfigError(f"Task.step_fn returned a dict without 'loss' (its keys: {', '.join(map(str, value))}); "
                          "return {'loss': loss, figure: value, ...}")
    figures = {key: figure for key, figure in value.items() if key not in ("loss", "count")}
    undeclared = [key for key in figures if key not in declared]
    if undeclared:
        raise ConfigError(f"Task.step_fn returned the figure {undeclared[0]!r}, which Task.step_figures does "
                          f"not declare; add step_figures={{{undeclared[0]!r}: 'mean'}} (or 'sum', 'max')")
    for key, figure in figures.items() if check else ():
        if not (isinstance(figure, (int, float)) and not isinstance(figure, bool)
                or isinstance(figure, torch.Tensor) and figure.numel() == 1):
            raise ConfigError(f"Task.step_fn's figure {key!r} is a {type(figure).__name__}; return a number or "
                              "a one-element tensor")
    return ((value["loss"], value["count"]) if "count" in value else value["loss"]), figures


def check_pair(batch: Any) -> None:
    """ConfigError unless ``batch`` is an ``(inputs, target)`` pair, the shape loss_fn needs."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ConfigError(f"Task.loss_fn needs (inputs, target) batches, but a batch is a {type(batch).__name__}"
                          f"{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}; for other batches "
                          "give step_fn(model, batch) -> loss instead")


def split_loss(value: Any, name: str, check: bool = False) -> tuple[torch.Tensor, Any]:
    """``(loss, None)`` for a mean loss, ``(sum, count)`` when Task.``name`` returned that pair
    (a sum over ``count`` units, e.g. the tokens that are not padding). ``check``: ConfigError
    (one line) unless the loss is a scalar floating-point tensor that autograd can train."""
    loss, count = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
    if check:
        check_loss(loss, name)
        if isinstance(value, tuple) and not isinstance(count, (int, float, torch.Tensor)):
            raise ConfigError(f"Task.{name} returned ({type(loss).__name__}, {type(count).__name__}); the pair "
                              "form is (loss_sum, count) with count a number or a tensor")
    return loss, count


def check_loss(loss: Any, name: str) -> None:
    """ConfigError unless ``loss`` (returned by Task.``name``) is a scalar floating-point tensor
    that has a gradient to follow."""
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"Task.{name} returned a {type(loss).__name__}, not a loss tensor; return a scalar "
                          "floating-point tensor (or (loss_sum, count))")
    if not (loss.dim() == 0 and loss.is_floating_point()):
        raise ConfigError(f"Task.{name} returned a tensor of shape {tuple(loss.shape)} and dtype "
                          f"{str(loss.dtype).removeprefix('torch.')}, not a scalar floating-point loss; reduce it, "
                          "e.g. with .float().mean()")
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise ConfigError(f"Task.{name} returned a loss that does not depend on any trainable parameter "
                          "(detached: .item(), .detach(), torch.no_grad() or a new tensor); return the loss "
                          "autograd computed from the model's output")
