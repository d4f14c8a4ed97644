"""The job's store as the watchdogs see it: a notice board of heartbeats, one verdict, stacks,
and who has left.

Every rank's watchdog thread opens its own connection to the store the process group
rendezvoused on (launch/group.connect_store), and every key lives under one attempt's prefix,
so a job restarted by ``--max-restarts`` starts from a clean board.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..comm import round_prefix
from .flight import Collective

LINGER_S = 2.0  # the store's host waits this long at most for the other ranks to leave first


@dataclass(frozen=True)
class Heartbeat:
    """What a rank publishes: how many of ddptrain's collectives it entered, whether it is inside
    one, where, and the collective it is in by torch's Flight Recorder (flight.py), which sees
    the task's own collectives too."""

    arrivals: int
    inside: bool
    where: str
    collective: Collective | None = None

    @property
    def waits(self) -> bool:
        """Inside a collective, by ddptrain's marks or by the recorder."""
        return self.inside or self.collective is not None

    def encode(self) -> str:
        collective = self.collective.encode() if self.collective else ""
        return f"{self.arrivals}|{int(self.inside)}|{collective}|{self.where}"

    @classmethod
    def decode(cls, text: str) -> Heartbeat:
        arrivals, inside, collective, where = text.split("|", 3)
        return cls(int(arrivals), inside == "1", where, Collective.decode(collective))


def store_answers(host: str, port: int, wait_s: float) -> bool:
    """Whether the store answers a connection of its own (connect, greeting, one ``check``)
    within ``wait_s``. torch's client waits for ever on a store that accepts and never answers
    (a frozen host: its timeout bounds the retries, not the greeting), so the probe runs in a
    thread of its own, left behind when it does not return; and refused connections are found
    by a plain socket first (torch's client logs every retry with its C++ frames)."""
    try:
        socket.create_connection((host, port), timeout=wait_s).close()
    except OSError:
        return False
    answered = threading.Event()

    def probe() -> None:
        try:  # (patient: the wait below is the bound, and a retry's warning must not print meanwhile)
            dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(minutes=10)).check(["ddptrain/probe"])
            answered.set()
        except Exception:  # noqa: BLE001 - reset, closed: no answer
            pass
    threading.Thread(target=probe, name="ddptrain-store-probe", daemon=True).start()
    return answered.wait(wait_s)


class Board:
    def __init__(self, host: str, port: int, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.prefix = round_prefix()
        self.store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=30))
        self.store.set(self._key(f"info/{rank}"), json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        # (made by whoever comes first, never overwritten; torch's stub omits the store's append)
        self.store.append(self._key("hb_ranks"), "")  # type: ignore[attr-defined]
        self.left = False
        self.listed = False  # this rank's name is in hb_ranks: it published a heartbeat

    def _key(self, name: str) -> str:
        return self.prefix + name

    # --- heartbeats ------------------------------------------------------------------------
    def publish(self, beat: Heartbeat) -> None:
        self.store.set(self._key(f"hb/{self.rank}"), beat.encode())
        if not self.listed:  # after the heartbeat: a rank listed has one to read
            self.store.append(self._key("hb_ranks"), f"{self.rank},")  # type: ignore[attr-defined]  # (as above)
            self.listed = True

    def heartbeats(self) -> dict[int, Heartbeat | None]:
        """Every rank's newest heartbeat (None: it never published one), in two requests at any
        number of ranks: the list of ranks that published, then their heartbeats. (Reading every
        rank's key, with a check for each one missing, cost rank 0 two requests per rank not yet
        started, every period: at 4,096 ranks starting up, thousands a second on the store they
        were connecting to, and some never got through.)"""
        listed = self.store.get(self._key("hb_ranks")).decode()
        ranks = sorted({int(rank) for rank in listed.split(",") if rank})
        texts = self.store.multi_get([self._key(f"hb/{rank}") for rank in ranks]) if ranks else []
        posted = dict(zip(ranks, texts))
        return {rank: Heartbeat.decode(posted[rank].decode()) if rank in posted else None
                for rank in range(self.world_size)}

    # --- the verdict -----------------------------------------------------------------------
    def verdict(self) -> dict[str, Any] | None:
        key = self._key("verdict")
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def propose(self, verdict: dict[str, Any]) -> dict[str, Any]:
        """Post ``verdict`` unless one is there already (compare-and-set): the job's verdict."""
        proposed = json.dumps(verdict)
        return json.loads(self.store.compare_set(self._key("verdict"), "", proposed))

    # --- stacks ----------------------------------------------------------------------------
    def post_stack(self, text: str) -> None:
        self._post("stack", text)

    def stacks(self, ranks: list[int], wait_s: float) -> dict[int, str | None]:
        """Each rank's posted stack, waiting up to ``wait_s`` in all (None: it did not answer)."""
        return self._posted("stack", ranks, time.monotonic() + wait_s)

    def post_summary_written(self) -> None:
        self.store.set(self._key("hang_summary/0"), "1")

    def wait_summary_written(self, wait_s: float) -> bool:
        """Whether rank 0 wrote the hang's summary within ``wait_s``: until then every rank stays,
        so no rank's exit breaks a slower rank's collective before its stack is taken (the stack
        would show the rank's way out, not where it hung: seen under load)."""
        try:  # the server answers when the key is set: no polling by thousands of ranks
            self.store.wait([self._key("hang_summary/0")], datetime.timedelta(seconds=wait_s))
            return True
        except RuntimeError:  # (torch's DistStoreError on a timeout is one)
            return False

    def post_collectives(self, recent: list[Collective]) -> None:
        self._post("collectives", "\n".join(c.encode() for c in recent))

    def collectives(self, wait_s: float) -> dict[int, list[Collective]]:
        """Every rank's recent collectives (flight.recent) that arrived within ``wait_s``."""
        posted = self._posted("collectives", list(range(self.world_size)), time.monotonic() + wait_s)
        return {rank: [c for c in map(Collective.decode, text.splitlines()) if c is not None]
                for rank, text in posted.items() if text is not None}

    def _post(self, kind: str, text: str) -> None:
        """This rank's ``kind`` key, then its name on the list of ranks that posted one."""
        self.store.set(self._key(f"{kind}/{self.rank}"), text)
        self.store.append(self._key(f"{kind}_ranks"), f"{self.rank},")  # type: ignore[attr-defined]

    def _posted(self, kind: str, ranks: list[int], deadline: float) -> dict[int, str | None]:
        """Each rank's ``kind`` key, once all are there or at ``deadline``: one request per poll
        (the list of ranks that posted), then one for the values, at any number of ranks. (A
        read that checked each missing rank's key made two requests per rank: at 4,096 ranks
        with a few silent, 8,000 round trips after every hang.)"""
        listed = self._key(f"{kind}_ranks")
        self.store.append(listed, "")  # type: ignore[attr-defined]  # (made if nobody posted yet)
        wanted = set(ranks)
        while True:
            present = wanted & {int(rank) for rank in self.store.get(listed).decode().split(",") if rank}
            if present == wanted or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        found = sorted(present)
        values = self.store.multi_get([self._key(f"{kind}/{rank}") for rank in found]) if found else []
        texts = {rank: value.decode() for rank, value in zip(found, values)}
        return {rank: texts.get(rank) for rank in ranks}

    # --- leaving ---------------------------------------------------------------------------
    def leave(self, wait_for_others: bool, gone: set[int] | frozenset[int] = frozenset(),
              within_s: float = LINGER_S) -> None:
        """Mark this rank as leaving (once). The store's host (``wait_for_others``) waits briefly
        (``within_s`` at most) for every other rank to leave first, so nobody finds the store gone
        while still reading a verdict; not for those ``gone`` (ranks whose process is known to have
        ended)."""
        if self.left:
            return
        self.left = True
        try:
            self.store.set(self._key(f"left/{self.rank}"), "1")
            if wait_for_others:
                others = [self._key(f"left/{r}") for r in range(self.world_size) if r != self.rank and r not in gone]
                deadline = time.monotonic() + within_s
                while others and not self.store.check(others) and time.monotonic() < deadline:
                    time.sleep(0.02)
        except Exception:  # noqa: BLE001 - the store went first: nothing to wait for
            pass
