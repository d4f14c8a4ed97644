"""``ddptrain plan``'s command: the target's shape and the machine's figures from the flags, then
the plan of the job (job.py) printed as a table (report.py) or JSON, or the layouts that fit
(``--fit``: fit.py). The flags themselves are cli.py's (``_add_plan_parser``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from ..errors import ConfigError
from ..settings import RunConfig, flag
from .fit import Layout, fit_layouts, format_fit, none_fits
from .hardware import Hardware
from .job import chosen_ranks, make_plan, refusals, steady_step, with_global_batch
from .rank import Target
from .report import format_plan


def plan_job(args: argparse.Namespace, prepare: Callable[[], tuple[RunConfig, Any]], given: dict[str, Any]) -> int:
    """``ddptrain plan``: the target and the machine's figures checked, then the job (``prepare``:
    its settings and factory, checked as train checks them) planned, or its layouts (--fit)."""
    target = plan_target(args.world_size, args.nnodes, args.nproc_per_node)
    hw = Hardware(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Hardware)})
    hw.check()
    cfg, factory = prepare()
    fewest = steady_step(cfg.strategy) + 1
    steps = fewest if args.steps is None else args.steps
    if steps < fewest:
        raise ConfigError(f"--steps {steps}: a plan of --strategy {cfg.strategy} runs at least {fewest} steps (the "
                          "steps before are not steady: DDP rebuilds its buckets and shares their order in its "
                          f"second); give --steps {fewest} or more")
    cfg = with_global_batch(cfg, target, args.global_batch)
    # the ranks' device: a plan is for GPUs (--device auto) unless told cpu; its optimizer defaults are planned
    target = dataclasses.replace(target, device="cpu" if cfg.device == "cpu" else "cuda")
    shown = sys.stderr if sys.stderr.isatty() and not args.json else None  # what each rank is doing, meanwhile
    if args.fit:
        return fit_command(args, cfg, factory, target, hw, shown, given)
    found = make_plan(cfg, factory, target, chosen_ranks(args.ranks, target.world_size), hw, steps, args.fake_tensors,
                      shown)
    refused = refusals(found, cfg, hw)
    if args.json:
        print(json.dumps({**found, "refusals": refused}, indent=2))
    else:
        print(format_plan(found))
    for line in refused:
        print(f"ddptrain: error: {line}", file=sys.stderr)
    return 2 if refused else 0


def fit_command(args: argparse.Namespace, cfg: RunConfig, factory: Any, target: Target, hw: Hardware,
                shown: TextIO | None, given: dict[str, Any]) -> int:
    """``ddptrain plan --fit``: the layouts that fit, fastest first (fit.py)."""
    if hw.memory_per_rank_gb is None:
        raise ConfigError("--fit ranks the layouts that fit a rank's memory: give --memory-per-rank GB")
    say = (lambda line: print(line, file=shown, flush=True)) if shown is not None else None
    found = fit_layouts(cfg, factory, target, chosen_ranks(args.ranks, target.world_size), hw, args.fake_tensors, say)
    layout = {f.name for f in dataclasses.fields(Layout)}
    flags = [part for name, value in given.items() if name not in layout for part in _as_flags(name, value)]
    print(json.dumps(found, indent=2) if args.json else format_fit(found, flags))
    if not found["fitting"]:
        print(f"ddptrain: error: {none_fits(found)}", file=sys.stderr)
        return 2
    return 0


def _as_flags(name: str, value: Any) -> list[str]:
    """A given setting as train's flags (a flag that takes no value: itself, when set)."""
    if isinstance(value, bool):
        return [flag(name)] if value else []
    if isinstance(value, (list, tuple, dict)):
        return []  # (repeated or table settings: given to this plan, not shown again)
    return [flag(name), str(value)]


def plan_target(world_size: int | None, nnodes: int | None, per_node: int | None) -> Target:
    """The target's shape from --world-size, --nnodes and --nproc-per-node."""
    if world_size is None and nnodes is None:
        raise ConfigError("ddptrain plan needs the target's size: --world-size W, or --nnodes N --nproc-per-node G")
    for flag_name, given in (("--world-size", world_size), ("--nnodes", nnodes), ("--nproc-per-node", per_node)):
        if given is not None and given < 1:
            raise ConfigError(f"{flag_name} must be at least 1, got {given}")
    if nnodes is not None:
        per_node = per_node or 8
        if world_size is not None and world_size != nnodes * per_node:
            raise ConfigError(f"--world-size {world_size} is not --nnodes {nnodes} x --nproc-per-node {per_node}; "
                              "give one or the other")
        world_size = nnodes * per_node
    assert world_size is not None
    per_node = per_node or min(world_size, 8)
    if world_size < 1 or per_node < 1 or world_size % per_node:
        raise ConfigError(f"--world-size {world_size} is not a whole number of nodes of --nproc-per-node {per_node}; "
                          "give sizes that divide")
    return Target(world_size, per_node)
