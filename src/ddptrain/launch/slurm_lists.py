"""Slurm's compressed lists, as its variables write them (``SLURM_JOB_NODELIST``,
``SLURM_TASKS_PER_NODE``): read without calling ``scontrol``, which a task may not have."""

from __future__ import annotations

import re


def expand_hostlist(hostlist: str) -> list[str]:
    """``gpu[01-04,07],login1`` -> gpu01 … gpu04, gpu07, login1 (ValueError if unreadable)."""
    return [host for item in _split_top_level(hostlist) for host in _expand_item(item)]


def expand_tasks_per_node(spec: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1] (ValueError if unreadable)."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.match(r"^(\d+)(?:\(x(\d+)\))?$", part.strip())
        if not match:
            raise ValueError(f"cannot read Slurm tasks per node {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _split_top_level(text: str) -> list[str]:
    """The comma-separated items outside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str) -> list[str]:
    """One item's hosts; its first bracket is expanded, then the rest of the name recursively."""
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        if "[" in item or "]" in item:
            raise ValueError(f"cannot read Slurm host list {item!r}")
        return [item]
    prefix, suffix = item[: match.start()], item[match.end():]
    names: list[str] = []
    for part in match.group(1).split(","):
        bounds = re.match(r"^(\d+)(?:-(\d+))?$", part.strip())
        if not bounds:
            raise ValueError(f"cannot read Slurm host list {item!r}")
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        names.extend(f"{prefix}{n:0{len(low)}d}" for n in range(int(low), int(high) + 1))
    return [host for name in names for host in _expand_item(name + suffix)]
