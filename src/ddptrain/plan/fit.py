"""``ddptrain plan --fit``: which layout of the job fits the target's memory, and which of those is
fastest, found by planning them (job.make_plan), not by rules of thumb.

A layout is a strategy (ddp, fsdp, and hsdp on more than one node), a tensor-parallel degree under
fsdp and hsdp (each that divides a node's ranks, where the task names layers to split), activation
checkpointing or not, and the batch per rank x accumulation that keeps the job's global batch.
For each strategy and degree the plans go from the cheapest layout to the most frugal: without
activation checkpointing at 1x, 2x and 4x the accumulation up to the first that fits, then with it
at less accumulation than that one (more accumulation, or recomputing at as much, only adds
time). The layouts that fit are ranked by the plan's step time; the first one's `ddptrain train`
flags are printed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..errors import ConfigError
from ..settings import RunConfig
from ..settings.checks import validate
from .hardware import Hardware
from .job import make_plan, refusals, steady_step
from .rank import Target

ACCUMULATIONS = (1, 2, 4)  # times the given --grad-accum: the batch per rank over them


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run the job on the target: what ``ddptrain train`` would be told."""

    strategy: str
    tp: int
    activation_checkpointing: bool
    batch_size: int
    grad_accum: int

    def settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flags(self) -> list[str]:
        """Its ``ddptrain train`` flags."""
        return ["--strategy", self.strategy, *(["--tp", str(self.tp)] if self.tp > 1 else []),
                *(["--activation-checkpointing"] if self.activation_checkpointing else []),
                "--batch-size", str(self.batch_size), "--grad-accum", str(self.grad_accum)]

    def name(self) -> str:
        """'fsdp --tp 2, checkpointed, batch 4 x 2'"""
        parts = [self.strategy + (f" --tp {self.tp}" if self.tp > 1 else "")]
        if self.activation_checkpointing:
            parts.append("checkpointed")
        return ", ".join([*parts, f"batch {self.batch_size} x {self.grad_accum}"])


def candidates(cfg: RunConfig, target: Target) -> list[list[Layout]]:
    """The layouts to try, in groups of one strategy and degree, each group cheapest first (the
    global batch of ``cfg`` kept: layouts it does not divide into are left out)."""
    global_batch = cfg.global_batch(cfg.data_ranks(target.world_size))
    degrees = [1] + [tp for tp in (2, 4, 8, 16) if target.nproc_per_node % tp == 0]
    strategies = [("ddp", 1)] + [("fsdp", tp) for tp in degrees]
    if target.nnodes > 1:
        strategies += [("hsdp", tp) for tp in degrees]
    groups = []
    for strategy, tp in strategies:
        group = []
        for checkpointed in (False, True):
            for times in ACCUMULATIONS:
                accumulation = cfg.grad_accum * times
                batch, rest = divmod(global_batch, accumulation * (target.world_size // tp))
                if batch >= 1 and not rest:
                    group.append(Layout(strategy, tp, checkpointed, batch, accumulation))
        if group:
            groups.append(group)
    return groups


def fit_layouts(cfg: RunConfig, factory: Any, target: Target, ranks: list[int], hw: Hardware,
                fake: bool = False, say: Any = None) -> dict[str, Any]:
    """Every layout tried (its peak, step time and why it does not fit, if it does not), the ones
    that fit ranked by step time, and how long the search took. ``say``: told each layout as its
    plan begins."""
    began = time.monotonic()
    tried: list[dict[str, Any]] = []
    left_out: list[str] = []

    def planned(layout: Layout) -> dict[str, Any] | str:
        if say is not None:
            say(f"ddptrain plan --fit: planning {layout.name()} ({len(tried) + 1} so far)")
        return _try(cfg, factory, target, ranks, hw, fake, layout)

    no_split_plan = False
    for group in candidates(cfg, target):
        if group[0].tp > 1 and no_split_plan:
            continue  # (no degree can split a model the task names no layers of)
        outcomes = _group_outcomes(group, planned)
        if isinstance(outcomes, str):  # the task or the settings cannot run this group's layouts
            left_out.append(outcomes)
            no_split_plan = no_split_plan or "names no layers to split" in outcomes
            continue
        tried += outcomes
    # by step time; a tie (a step the collectives' latency bounds) to fewer micro-batches, no recomputing
    fitting = sorted((t for t in tried if t["fits"]),
                     key=lambda t: (t["step_s_serial"], t["grad_accum"], t["activation_checkpointing"], t["tp"]))
    return {"world_size": target.world_size, "global_batch": cfg.global_batch(cfg.data_ranks(target.world_size)),
            "memory_per_rank_gb": hw.memory_per_rank_gb, "tried": tried, "fitting": fitting, "left_out": left_out,
            "seconds": time.monotonic() - began}


def _group_outcomes(group: list[Layout], planned: Any) -> list[dict[str, Any]] | str:
    """One strategy and degree's layouts planned from the least accumulation to the first that
    fits, without activation checkpointing, then with it at less accumulation than that one (with
    as much or more, recomputing only adds time); a str: why the group cannot run at all."""
    outcomes: list[dict[str, Any]] = []
    plain_fit = None  # the accumulation the plain layouts first fit at
    for checkpointed in (False, True):
        for layout in (lay for lay in group if lay.activation_checkpointing == checkpointed):
            if checkpointed and plain_fit is not None and layout.grad_accum >= plain_fit:
                break
            outcome = planned(layout)
            if isinstance(outcome, str):
                return outcome
            outcomes.append(outcome)
            if outcome["fits"]:
                if not checkpointed:
                    plain_fit = layout.grad_accum
                break  # (more accumulation only adds time)
    return outcomes


def _try(cfg: RunConfig, factory: Any, target: Target, ranks: list[int], hw: Hardware, fake: bool,
         layout: Layout) -> dict[str, Any] | str:
    """The layout planned: its peak, step time and refusals (none: it fits); a str where the task
    or the settings cannot run it at all: train's own line (a task without a tensor-parallel plan
    under --tp, a layer --tp does not divide, DDP's buckets beyond this machine under --fake-tensors)."""
    changed = cfg.replace(**layout.settings())
    try:
        validate(changed)
        plan = make_plan(changed, factory, target, ranks, hw, steady_step(layout.strategy) + 1, fake)
    except ConfigError as error:
        return f"{layout.name()}: {error}"
    refused = refusals(plan, changed, hw)
    time_ = plan["time"]
    return {**layout.settings(), "peak_bytes": max(r["peak_bytes"] for r in plan["ranks"]),
            "model_state_bytes": max(r["parameter_bytes"] + r["gradient_bytes"] + r["optimizer_bytes"]
                                     for r in plan["ranks"]),
            "activation_bytes": max(r["activation_bytes"] for r in plan["ranks"]),
            "step_s_overlapped": time_["step_s_overlapped"], "step_s_serial": time_["step_s_serial"],
            "fits": not refused, "refusals": refused, "flags": layout.flags()}


def none_fits(found: dict[str, Any]) -> str:
    """The one line that says no layout fits, and what would: the most frugal layout tried, by how
    much it is over, and which part of its peak a change shrinks (or, where no layout could be
    planned at all, why the first could not)."""
    if not found["tried"]:
        return f"no layout of the job could be planned: {found['left_out'][0]}"
    frugal = min(found["tried"], key=lambda t: t["peak_bytes"])
    layout = Layout(**{f.name: frugal[f.name] for f in dataclasses.fields(Layout)})
    over = frugal["peak_bytes"] / 1e9 - (found["memory_per_rank_gb"] or 0)
    state, activations = frugal["model_state_bytes"] / 1e9, frugal["activation_bytes"] / 1e9
    remedy = ("more ranks (its model state, sharded, shrinks with them) or devices with more memory"
              if state >= activations else
              "a smaller global batch (--global-batch; its activations are per sample) or devices with more memory")
    reasons = {line for t in found["tried"] for line in t["refusals"] if "--memory-per-rank" not in line}
    other = f"; and: {sorted(reasons)[0]}" if reasons else ""
    return (f"none of the {len(found['tried'])} layouts tried fits on {found['world_size']:,} ranks at global batch "
            f"{found['global_batch']:,}: the most frugal, {layout.name()}, needs {frugal['peak_bytes'] / 1e9:.3g} GB "
            f"a rank, {over:.3g} GB above --memory-per-rank {found['memory_per_rank_gb']:g} (model state "
            f"{state:.3g} GB, activations {activations:.3g} GB); use {remedy}{other}")


def format_fit(found: dict[str, Any], task_flags: list[str]) -> str:
    """The layouts that fit, fastest first, those that do not, and the best one's command."""
    from .report import seconds, size

    lines = [f"ddptrain plan --fit: {len(found['tried'])} layouts planned on {found['world_size']:,} ranks at global "
             f"batch {found['global_batch']:,} in {found['seconds']:.0f} s; {len(found['fitting'])} fit "
             f"--memory-per-rank {found['memory_per_rank_gb']:g}", ""]
    for number, t in enumerate(found["fitting"], 1):
        lines.append(f"  {number}. {_name(t):40s} peak {size(t['peak_bytes']):>9s} a rank, step "
                     f"{seconds(t['step_s_overlapped'])} to {seconds(t['step_s_serial'])}")
    misses = [t for t in found["tried"] if not t["fits"]]
    if misses:
        lines += ["", "do not fit:"]
        lines += [f"  {_name(t):43s} peak {size(t['peak_bytes']):>9s} a rank{_not_memory(t)}" for t in misses]
    lines += [f"left out: {why}" for why in found["left_out"]]
    if found["fitting"]:
        lines += ["", "best: ddptrain train " + " ".join([*task_flags, *found["fitting"][0]["flags"]])]
    return "\n".join(lines)


def _not_memory(t: dict[str, Any]) -> str:
    """Why a layout within the memory does not fit (its plan's first refusal), else nothing."""
    if any("--memory-per-rank" in line for line in t["refusals"]):
        return ""
    return f" ({t['refusals'][0]})" if t["refusals"] else ""


def _name(t: dict[str, Any]) -> str:
    return Layout(**{f.name: t[f.name] for f in dataclasses.fields(Layout)}).name()
