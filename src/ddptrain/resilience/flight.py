"""Which collective each rank is in, from torch's Flight Recorder, and what a hang's
collectives say about it (a desync: ranks in different collectives).

torch records every collective a process group runs (its op, sequence number, tensor shapes
and dtypes, process group) in a ring buffer when ``TORCH_FR_BUFFER_SIZE`` is set; ddptrain
sets it before joining the group. When a rank has not moved for a period, its watchdog thread
reads the buffer (about a millisecond, off the step's path) and publishes the oldest collective
this rank entered and has not left, so a collective the task calls itself (``dist.all_reduce``
in a loss) is seen as well as ddptrain's own. On gloo an entry is ``retired`` once its work
completes; on NCCL its ``state`` becomes ``completed`` (untested here: no GPU).

When the ranks hang, ``classify`` compares their collectives: a rank that is not in one
(it never arrived), ranks at another sequence number than the rest (one called a collective
more, or skipped one), ranks in another op, or the same op with other shapes.
"""

from __future__ import annotations

import os
import pickle
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..console import rank_list

BUFFER_ENTRIES = 256  # the last collectives each rank keeps; a hang needs only the newest


def enable() -> None:
    """Turn the recorder on for the groups this process creates (a user's own setting wins)."""
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(BUFFER_ENTRIES)


@dataclass(frozen=True)
class Collective:
    """One collective a rank is in."""

    group: str  # the process group's name ("default_pg", or its description)
    seq: int  # its sequence number in that group: equal on every rank for the same call
    op: str  # "all_reduce", "all_gather", "broadcast", ...
    shapes: str  # the input tensors' shapes and dtypes: "[21] float32"

    def describe(self) -> str:
        group = "" if self.group == "default_pg" else f" of group {self.group}"
        return f"{self.op} #{self.seq}{group} ({self.shapes})"

    def encode(self) -> str:
        return f"{self.group};{self.seq};{self.op};{self.shapes}"

    @classmethod
    def decode(cls, text: str) -> Collective | None:
        if not text:
            return None
        group, seq, op, shapes = text.split(";", 3)
        return cls(group, int(seq), op, shapes)


# The recorder's dtype names (c10's ScalarType) as torch users write them.
DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
          "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}


def _shapes(entry: dict[str, Any]) -> str:
    sizes, dtypes = entry.get("input_sizes") or [], entry.get("input_dtypes") or []
    parts = [f"{list(size)} {DTYPES.get(str(dtype), str(dtype))}" for size, dtype in zip(sizes, dtypes)]
    if len(parts) > 3:
        parts = parts[:3] + [f"{len(sizes) - 3} more"]
    return ", ".join(parts) or "no tensors"


def _unfinished(entry: dict[str, Any]) -> bool:
    return not entry.get("retired", False) and entry.get("state") != "completed"


def in_flight(entries: list[dict[str, Any]] | None = None) -> Collective | None:
    """The oldest collective this process entered and has not left (None: none, or no recorder).
    ``entries``: the recorder's entries (read now when not given)."""
    if entries is None:
        entries = recorded()
    for entry in entries:
        if _unfinished(entry) and not entry.get("is_p2p", False):
            return _collective(entry)
    return None


def last_entered() -> Collective | None:
    """The collective a failing rank was in: the one in flight, else the newest (a collective
    that failed because its peer died is finished, with an error)."""
    entries = [entry for entry in recorded() if not entry.get("is_p2p", False)]
    return in_flight(entries) or (_collective(entries[-1]) if entries else None)


def recent(count: int = 8) -> list[Collective]:
    """This rank's newest ``count`` collectives, oldest first (what a hang's judge compares)."""
    return [_collective(entry) for entry in recorded() if not entry.get("is_p2p", False)][-count:]


def _collective(entry: dict[str, Any]) -> Collective:
    group = entry.get("process_group") or ["", ""]
    op = str(entry.get("profiling_name", "?")).split(":")[-1]
    return Collective(str(group[1] or group[0]), int(entry.get("collective_seq_id", 0)), op, _shapes(entry))


def recorded() -> list[dict[str, Any]]:
    """The recorder's entries, oldest first, without stack traces ([] when it is off or absent)."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    dump = getattr(c10d, "_dump_fr_trace", None)  # private: absent in some builds
    if dump is None:
        return []
    try:
        return list(pickle.loads(dump(True, False, False)).get("entries", []))
    except Exception:  # noqa: BLE001 - a recorder this torch cannot dump is a recorder we do without
        return []


@dataclass(frozen=True)
class Desync:
    """What the hung ranks' collectives say: the ranks at fault, and one line on why."""

    culprits: list[int]
    reason: str


def classify(collectives: dict[int, Collective | None]) -> Desync | None:
    """Compare the collectives every rank is in (None: it is in none). None when they agree (or
    no rank is in one): then the hang is in the collective itself, or the marks explain it."""
    inside = {rank: c for rank, c in collectives.items() if c is not None}
    if not inside:
        return None
    absent = sorted(rank for rank, c in collectives.items() if c is None)
    if absent:
        return Desync(absent, f"{rank_list(absent)} in no collective while {_where(inside)}")
    by_seq = Counter((c.group, c.seq) for c in inside.values())
    if len(by_seq) > 1:
        return _minority(inside, lambda c: (c.group, c.seq), "at another collective than the rest")
    return _other_calls(inside, " at the same collective")


def first_disagreement(histories: dict[int, list[Collective]]) -> Desync | None:
    """The first collective the ranks called differently, from each rank's recent collectives:
    at the lowest sequence number that two ranks' histories both cover, the ranks whose op or
    shapes differ from the most common call (a rank that called an extra collective, or another
    shape, shows there even when gloo let the mismatched calls run on out of step). None when
    every covered collective agrees."""
    calls: dict[tuple[str, int], dict[int, Collective]] = {}
    for rank, history in histories.items():
        for c in history:
            calls.setdefault((c.group, c.seq), {})[rank] = c
    for _key, at in sorted(calls.items(), key=lambda item: item[0][1]):
        if len(at) > 1 and (found := _other_calls(at)):
            return found
    return None


def _other_calls(at: dict[int, Collective], context: str = "") -> Desync | None:
    """At one collective: the ranks whose op or shapes differ from the most common call."""
    if len({(c.op, c.shapes) for c in at.values()}) < 2:
        return None
    what = f"in another op{context}" if len({c.op for c in at.values()}) > 1 else "in the same op with other shapes"
    return _minority(at, lambda c: (c.op, c.shapes), what)


def _minority(inside: dict[int, Collective], key: Any, what: str) -> Desync:
    """The ranks outside the largest agreeing set are at fault; with no single largest set
    (two ranks, say) every rank is named and the reader decides."""
    counts = Counter(key(c) for c in inside.values())
    (top, n), *rest = counts.most_common()
    if rest and rest[0][1] == n:
        culprits = sorted(inside)
    else:
        culprits = sorted(rank for rank, c in inside.items() if key(c) != top)
    return Desync(culprits, f"{rank_list(culprits)} {what}: {_where(inside)}")


def _where(inside: dict[int, Collective]) -> str:
    """'rank 0, 2, 3 in all_reduce #10 ([4] float32); rank 1 in all_gather #10 ([4] float32)'."""
    groups: dict[str, list[int]] = {}
    for rank, c in sorted(inside.items()):
        groups.setdefault(c.describe(), []).append(rank)
    return "; ".join(f"{rank_list(ranks)} in {text}" for text, ranks in groups.items())
