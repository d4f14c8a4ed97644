"""The plan as a table for people (``--json`` gives the same dictionary to machines)."""

from __future__ import annotations

from typing import Any


def size(n: float) -> str:
    """Bytes as people read them: 1.5 GB, 320 KB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def seconds(s: float) -> str:
    if s == float("inf"):
        return "never"
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    return f"{s:.3g} s" if s >= 0.001 else f"{s * 1e6:.3g} us"


def _collective_line(c: dict[str, Any]) -> str:
    """'  2 x all_gather of 16,512 float32 (66 KB) over 8 ranks, inside a node: ring, 12 us each',
    and what it is for, where the plan says."""
    where = "inside a node" if c["in_node"] else "between nodes"
    what = f" ({c['what']})" if c.get("what") else ""
    return (f"  {c['count']} x {c['kind']} of {c['elements']:,} {c['dtype']} ({size(c['bytes'])}) over "
            f"{c['group']:,} ranks, {where}: {c['algorithm']}, {seconds(c['seconds'])} each{what}")


def _metadata(metadata_bytes: int) -> str:
    return f" (DCP's .metadata {size(metadata_bytes)} of it, modelled)" if metadata_bytes else ""


def format_plan(plan: dict[str, Any]) -> str:
    t, hw, time, plane = plan["target"], plan["hardware"], plan["time"], plan["control_plane"]
    layout, over = t["strategy"], "ranks"
    if t["tp"] > 1:  # a tensor-parallel group's ranks see the same samples: the batch counts groups
        layout, over = f"{layout} --tp {t['tp']}", f"{t['data_ranks']:,} groups of {t['tp']}"
    lines = [f"plan: {layout} on {t['world_size']:,} ranks ({t['nnodes']:,} node(s) x {t['nproc_per_node']}), "
             f"batch {t['batch_size']} x accumulation {t['grad_accum']} x {over} = global batch {t['global_batch']:,}",
             "", _rank_table(plan["ranks"]), "", "collectives per step (the heaviest rank's, counted in step "
             f"{t['steps_planned']} of {t['steps_planned']}):"]
    lines += [_collective_line(c) for c in plan["collectives_per_step"]]
    if not plan["collectives_per_step"]:
        lines.append("  none (one rank: nothing to synchronise)")
    if t["world_size"] > 1:
        agreement = plan["collectives_per_agreement"]
        lines += ["", f"every {agreement['every_steps']:,} step(s), the stop and snapshot agreement (every "
                  "0.5 s of steps), and the step records' sum beside it:"]
        lines += [_collective_line(c) for c in agreement["collectives"]]
        lines += ["", "per snapshot:"] + [_collective_line(c) for c in plan["collectives_per_snapshot"]]
    goodput = time["goodput"]
    lines += [
        "",
        f"step: compute {seconds(time['compute_s'])} at {hw['tflops']:g} TFLOP/s, communication "
        f"{seconds(time['communication_s'])} at {hw['link_gbps']:g} Gb/s between nodes ({hw['node_gbps']:g} inside) "
        f"and {hw['latency_us']:g} us a message; "
        f"{seconds(time['step_s_overlapped'])} to {seconds(time['step_s_serial'])} (overlapped to serial)",
        f"snapshot: {size(time['snapshot_total_bytes'])} in all{_metadata(time['dcp_metadata_bytes'])}; blocks the "
        f"step {seconds(time['blocking_s'])} "
        f"(copy at {hw['copy_gbs']:g} GB/s), written in {seconds(time['write_s'])} behind it "
        f"(at {hw['write_gbs']:g} GB/s), one every {seconds(time['snapshot_interval_s'])}",
        f"control plane: {plane['heartbeats_per_s']:,.3g} heartbeats/s and {plane['polls_per_s']:,.3g} verdict polls/s "
        f"at most on the store (beat every {seconds(plane['beat_period_s'])}); a failure ends every rank within "
        f"{seconds(plane['failure_to_exit_s'])}",
        f"goodput: {'n/a (no snapshot before the end: a failure starts over)' if goodput is None else f'{goodput:.1%}'}"
        f" with a failure every {seconds(time['job_mttf_s'])} and {seconds(time['restart_s'])} per restart",
    ]
    lines += [f"note: {note}" for note in plan["notes"]]
    return "\n".join(lines)


def _rank_table(ranks: list[dict[str, Any]]) -> str:
    columns = [("rank", lambda r: str(r["rank"])), ("params", lambda r: size(r["parameter_bytes"])),
               ("grads", lambda r: size(r["gradient_bytes"])), ("optimizer", lambda r: size(r["optimizer_bytes"])),
               ("activations", lambda r: size(r["activation_bytes"])),
               ("gathered", lambda r: size(r["gathered_bytes"])),
               ("peak", lambda r: size(r["peak_bytes"])), ("snapshot", lambda r: size(r["snapshot_bytes"])),
               ("train samples/epoch", lambda r: "stream" if r["train_samples"] is None else f"{r['train_samples']:,}"),
               ("steps/epoch", lambda r: "stream" if r["steps_per_epoch"] is None else f"{r['steps_per_epoch']:,}"),
               ("eval samples", lambda r: "-" if r["eval_samples"] is None else f"{r['eval_samples']:,}"),
               ("TFLOP/step", lambda r: f"{r['flops_per_step'] / 1e12:.3g}")]
    rows = [[name for name, _ in columns]] + [[cell(r) for _, cell in columns] for r in ranks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows) + \
        "\n(peak: the most bytes of tensors held at once in a step, measured; x1.10 for the allocator)"
