"""``--tp N`` with ``--strategy fsdp``: tensor parallelism inside groups of N consecutive ranks,
composed with FSDP2 across the groups (a 2-D mesh, ``("dp", "tp")``).

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
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from ..comm import DistContext
from ..errors import ConfigError
from ..settings import ParallelSettings
from ..tasks.protocol import Task, is_metric_object
from .fsdp import FSDPStrategy

# Task.tp_plan's styles: the names Hugging Face's base_model_tp_plan and torchtitan use.
STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
SPLIT = {"colwise": ("out_features", "num_embeddings"), "rowwise": ("in_features", "embedding_dim")}


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
                              f"{' or '.join(STYLES)}")
        matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ConfigError(f"Task.tp_plan[{pattern!r}] names no module of the model (its modules: "
                              f"{', '.join(list(names)[:6])}{' ...' if len(names) > 6 else ''})")
        for name in matched:
            _check_splits(name, names[name], style, tp)
            plan[name] = STYLES[style]()
    return plan


def _check_splits(name: str, part: torch.nn.Module, style: str, tp: int) -> None:
    if not isinstance(part, (torch.nn.Linear, torch.nn.Embedding)):
        raise ConfigError(f"Task.tp_plan: {name} is a {type(part).__name__}; a {style} split takes a Linear or an "
                          "Embedding (name the layers inside it)")
    attribute = SPLIT[style][0 if isinstance(part, torch.nn.Linear) else 1]
    size = getattr(part, attribute)
    if size % tp:
        raise ConfigError(f"--tp {tp}: {name}'s {attribute} ({size}) does not divide into {tp} parts; use a --tp "
                          f"that divides it")


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
        self.counts_data = ctx.rank % self.tp == 0
        # DTensor's hint that a 2-D gather takes two collectives (model.pt's gather): nothing a user can act on
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    @functools.cached_property
    def grid(self) -> DeviceMesh:
        """The 2-D mesh: rank r is data-parallel rank r // tp, tensor-parallel rank r % tp."""
        return init_device_mesh(self.ctx.device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))

    def mesh(self) -> DeviceMesh | None:
        return self.grid["dp"]

    def wrap(self, module: torch.nn.Module, task: Task) -> torch.nn.Module:
        if not task.tp_plan:
            raise ConfigError(f"--tp {self.tp}: the task names no layers to split (Task.tp_plan: module-name patterns "
                              "to 'colwise' or 'rowwise'); give one, or drop --tp")
        objects = [name for name, metric in task.metrics.items() if is_metric_object(metric)]
        if objects:  # (their states sync over every rank: a group's ranks would count each sample N times)
            raise ConfigError(f"--tp {self.tp}: Task.metrics[{objects[0]!r}] is a metric object, which --tp does "
                              "not count once per sample yet; return its figure from eval_fn as a sum, or drop --tp")
        module.to(self.ctx.device)
        parallelize_module(module, self.grid["tp"], resolve_plan(module, task.tp_plan, self.tp))
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
            coordinate = list(grad.device_mesh.get_coordinate() or ())
            split = grad.device_mesh.mesh_dim_names == ("dp", "tp")
            if (split or self.counts_data) and all(c == 0 for c, p in zip(coordinate, grad.placements)
                                                   if isinstance(p, Replicate)):
                counted.append(grad.to_local())
        return counted
