"""``--tp N`` with ``--strategy fsdp``: tensor parallelism inside groups of N consecutive ranks,
composed with FSDP2 across the groups (a 2-D mesh, ``("dp", "tp")``); with ``--strategy hsdp``,
HSDP across them (a 3-D mesh, ``("replicate", "shard", "tp")``).

The layers the task's ``Task.tp_plan`` names are split over a group's N ranks by torch's DTensor
tensor parallelism (``parallelize_module``: a column-wise layer's output features, a row-wise
layer's input features, its output summed over the group); then FSDP2 shards every block over the
data-parallel dimension, as ``--strategy fsdp`` does over the world. A group's N ranks see the same
samples and compute one data-parallel rank's step together: the batch is split over the world / N
groups (``data_context``). Sums over the world count each sample once: a loss part is this
rank's share of the world's (its group's ranks hold the same), and counts and evaluation sums
come from a group's first rank alone (``counts_data``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from ..comm import DistContext
from ..errors import ConfigError
from ..settings import ParallelSettings
from ..tasks.protocol import Task, is_metric_object
from .fsdp import FSDPStrategy

# Task.tp_plan's styles, named as Hugging Face's tp plans and torchtitan name them: whether the
# layer is split column-wise (a Linear's output features, an Embedding's features) or row-wise (a
# Linear's input features, an Embedding's rows: its vocabulary), and whether its output is gathered
# whole (an LM head's logits, for a loss over the whole vocabulary).
STYLES = {"colwise": ("colwise", False), "rowwise": ("rowwise", False),
          "colwise_gather_output": ("colwise", True),  # HF's lm_head
          "embedding_rowwise": ("rowwise", False)}  # HF's embed_tokens
SPLIT = {"colwise": ("out_features", "embedding_dim"), "rowwise": ("in_features", "num_embeddings")}


def resolve_plan(module: torch.nn.Module, patterns: Mapping[str, str], tp: int) -> dict[str, ParallelStyle]:
    """``Task.tp_plan``'s module-name patterns (fnmatch: ``blocks.*.mlp.up``) as torch's plan of
    module names to styles; ConfigError (one line) for a style torch's TP here does not take, a
    pattern that names no module, a module that is not a Linear or an Embedding, or a dimension
    ``tp`` does not divide."""
    names = {name: part for name, part in module.named_modules() if name}
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in patterns.items():
        if style not in STYLES:
            raise ConfigError(f"Task.tp_plan[{pattern!r}]: style {style!r} is not one ddptrain splits (yet); use "
                              f"{', '.join(STYLES)}")
        matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ConfigError(f"Task.tp_plan[{pattern!r}] names no module of the model (its modules: "
                              f"{', '.join(list(names)[:6])}{' ...' if len(names) > 6 else ''})")
        for name in matched:
            _check_splits(name, names[name], style, tp)
            plan[name] = _style(style, names[name])
    return plan


def _style(style: str, part: torch.nn.Module) -> ParallelStyle:
    split, gathered = STYLES[style]
    if split == "colwise":
        return ColwiseParallel(output_layouts=Replicate()) if gathered else ColwiseParallel()
    # a row-wise Embedding's input is the whole batch of token ids (torch's default: a share of features)
    return RowwiseParallel(input_layouts=Replicate()) if isinstance(part, torch.nn.Embedding) else RowwiseParallel()


def model_plan(task: Task, module: torch.nn.Module) -> Mapping[str, str] | None:
    """The task's plan, else the model's own (a Hugging Face model's ``tp_plan``: its config's
    ``base_model_tp_plan`` under the base model's prefix, and its LM head's), else None."""
    if task.tp_plan:
        return task.tp_plan
    own = getattr(module, "tp_plan", None)
    return own if isinstance(own, Mapping) and own else None


def _check_splits(name: str, part: torch.nn.Module, style: str, tp: int) -> None:
    if not isinstance(part, (torch.nn.Linear, torch.nn.Embedding)):
        raise ConfigError(f"Task.tp_plan: {name} is a {type(part).__name__}; a {style} split takes a Linear or an "
                          "Embedding (name the layers inside it)")
    attribute = SPLIT[STYLES[style][0]][0 if isinstance(part, torch.nn.Linear) else 1]
    size = getattr(part, attribute)
    if size % tp:
        raise ConfigError(f"--tp {tp}: {name}'s {attribute} ({size}) does not divide into {tp} parts; use a --tp "
                          f"that divides it")


def tied_parameters(module: torch.nn.Module) -> list[list[tuple[str, str]]]:
    """The parameters several modules share (a language model's token embedding and its head),
    each as the (module name, attribute) pairs that hold it."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for name, part in module.named_modules(remove_duplicate=False):
        for attribute, param in part._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((name, attribute))
    return [places for places in holders.values() if len(places) > 1]


def retie(module: torch.nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """Tie again what ``parallelize_module`` untied: it gives each layer it splits a parameter of
    its own, so a tied embedding and head, both in the plan, became two copies trained apart. The
    first holder's parameter is every holder's, where they are split alike (an Embedding split by
    vocabulary and a column-wise head: both by rows); ConfigError (one line) where they are not."""
    for places in tied:
        (first_name, first_attribute), *others = places
        kept = getattr(module.get_submodule(first_name), first_attribute)
        for name, attribute in others:
            part = module.get_submodule(name)
            held = getattr(part, attribute)
            if held is kept:
                continue
            if getattr(held, "placements", None) != getattr(kept, "placements", None):
                raise ConfigError(f"Task.tp_plan splits the tied weights {first_name}.{first_attribute} and "
                                  f"{name}.{attribute} differently; split both by rows (an Embedding "
                                  "'embedding_rowwise', a head 'colwise' or 'colwise_gather_output') or neither")
            setattr(part, attribute, kept)


def _by_mesh(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """The parameters grouped by their gradients' mesh (torch's foreach ops take one mesh at a time)."""
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for param in params:
        groups.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    return list(groups.values())


class TensorParallelStrategy(FSDPStrategy):
    """FSDP2 over the data-parallel dimension of a ``(world / tp, tp)`` mesh, each group's ranks
    splitting the plan's layers (the module's text)."""

    def __init__(self, parallel: ParallelSettings, ctx: DistContext, precision: str = "fp32",
                 torchft: bool = False) -> None:
        super().__init__(parallel, ctx, precision, torchft)
        self.tp = parallel.tp
        if ctx.world_size % self.tp:
            raise ConfigError(f"--tp {self.tp} does not divide the world of {ctx.world_size} ranks into groups; use a "
                              f"--tp that divides it, or another number of ranks")
        self.dp = ctx.world_size // self.tp
        self.replicas = self._replicas(parallel, ctx) if parallel.strategy == "hsdp" else 0
        self.counts_data = ctx.rank % self.tp == 0
        # DTensor's hint that a 2-D gather takes two collectives (model.pt's gather): nothing a user can act on
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    def _replicas(self, parallel: ParallelSettings, ctx: DistContext) -> int:
        """--strategy hsdp: the replica groups of the data-parallel ranks (one a node by default,
        as hsdp's own: a node's ranks over --tp are its data-parallel ranks)."""
        nodes = max(1, ctx.world_size // ctx.local_world_size)
        replicas = parallel.replicas or nodes
        if self.dp % replicas:
            raise ConfigError(f"--replicas {replicas} does not divide the {self.dp} data-parallel groups of --tp "
                              f"{self.tp} into equal replica groups; choose a divisor of {self.dp}")
        return replicas

    @functools.cached_property
    def grid(self) -> DeviceMesh:
        """The 2-D mesh, rank r data-parallel rank r // tp and tensor-parallel rank r % tp; under
        hsdp the 3-D one, the data-parallel ranks in --replicas groups that each shard the model."""
        if self.replicas:
            return init_device_mesh(self.ctx.device.type, (self.replicas, self.dp // self.replicas, self.tp),
                                    mesh_dim_names=("replicate", "shard", "tp"))
        return init_device_mesh(self.ctx.device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))

    def mesh(self) -> DeviceMesh | None:
        """FSDP2's: the data-parallel dimension (hsdp's two)."""
        return self.grid["replicate", "shard"] if self.replicas else self.grid["dp"]

    def wrap(self, module: torch.nn.Module, task: Task) -> torch.nn.Module:
        plan = model_plan(task, module)
        if plan is None:
            raise ConfigError(f"--tp {self.tp}: the task names no layers to split (Task.tp_plan: module-name patterns "
                              "to 'colwise' or 'rowwise'), nor has the model a plan of its own (a Hugging Face "
                              "model's tp_plan); give one, or drop --tp")
        objects = [name for name, metric in task.metrics.items() if is_metric_object(metric)]
        if objects:  # (their states sync over every rank: a group's ranks would count each sample N times)
            raise ConfigError(f"--tp {self.tp}: Task.metrics[{objects[0]!r}] is a metric object, which --tp does "
                              "not count once per sample yet; return its figure from eval_fn as a sum, or drop --tp")
        if any(p.device != self.ctx.device for p in module.parameters()):  # (a plan's fake tensors cannot be
            module.to(self.ctx.device)  # swapped for themselves: `ddptrain plan --fake-tensors`)
        tied = tied_parameters(module)
        parallelize_module(module, self.grid["tp"], resolve_plan(module, plan, self.tp))
        retie(module, tied)
        return super().wrap(module, task)

    def data_context(self, ctx: DistContext) -> DistContext:
        """The data-parallel rank and world this rank's samples belong to: its group's."""
        return dataclasses.replace(ctx, rank=ctx.rank // self.tp, world_size=self.dp)

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """torch's clip_grads_with_norm_ with the whole model's norm: its parameters are on two
        meshes (split layers on the 2-D one, the rest on the data-parallel one), which torch's
        clip_grad_norm_ cannot stack; the norm's square is the sum over the world of each rank's
        counted squares (``counted_gradients``), one all-reduce."""
        having = [p for p in params if p.grad is not None]
        local = self.counted_gradients([p.grad for p in having if p.grad is not None])
        square = torch.zeros((), device=self.ctx.device)
        if local:
            square = torch.stack(torch._foreach_norm(local)).float().square().sum()
        dist.all_reduce(square)
        total = square.sqrt()
        for group in _by_mesh(having):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    def counted_gradients(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's share of the gradients' squares, summed over the world (observe/metrics.GradNorms):
        each shard once, by the rank first on every mesh dimension that replicates it (a layer not
        split is on the data-parallel mesh alone: every rank of a group holds the same shard of it)."""
        counted = []
        for grad in grads:
            assert isinstance(grad, DTensor), "every gradient of a --tp run is a DTensor"
            if self._counts(grad.device_mesh, grad.placements):
                counted.append(grad.to_local())
        return counted

    @functools.cache  # noqa: B019 (a few layouts per run; the strategy lives as long as the run)
    def _counts(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> bool:
        """Whether this rank counts a shard laid out so: asked once per layout, not per gradient and step."""
        coordinate = list(mesh.get_coordinate() or ())
        split = "tp" in (mesh.mesh_dim_names or ())
        return (split or self.counts_data) and all(c == 0 for c, p in zip(coordinate, placements)
                                                   if isinstance(p, Replicate))
