"""Where the replica groups meet, as the training loop sees it.

A job's replica groups stay one model in one of three ways, and the loop asks this one object
instead of knowing which:

- one group (no ``--sync``, no torchft): nothing to meet; every call here returns at once;
- torchft's groups, every step (``--fault-tolerance torchft``): the groups join a quorum before
  each step (a restarted group heals from a live peer there), and average their gradients inside
  the step (step.py, through ``ReplicaGroups.average``);
- ``--sync local-sgd|diloco``: the groups meet after every ``--sync-every``-th step, before an
  evaluation and at the end (parallel/semi_sync.py); under torchft also before the first step,
  where a group restarted while the others train waits, and heals at their next meeting.

A meeting's time (a failed group's stall, a heal) is counted as waiting in the run's goodput.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .parallel.semi_sync import SemiSync
from .resilience.replicas import ReplicaGroups


class GroupSync:
    """The replica groups' meetings for one rank's loop; ``waited(seconds)``: goodput's counter."""

    def __init__(self, replicas: ReplicaGroups | None, semi_sync: SemiSync | None,
                 waited: Callable[[float], None]) -> None:
        self.replicas, self.semi_sync, self._waited = replicas, semi_sync, waited
        self.save_at_sync = False  # --sync: a snapshot asked for between two syncs, taken at the next

    @property
    def every_step(self) -> bool:
        """torchft's groups meet before every step (they average gradients inside it)."""
        return self.replicas is not None and self.semi_sync is None

    @property
    def healed(self) -> bool:
        """This group took a live peer's state in its last meeting: the run stands where the peer's does."""
        return self.replicas is not None and self.replicas.healed

    def epoch_started(self) -> None:
        if self.replicas is not None:
            self.replicas.healed = False  # (a heal leaves the epoch: the next one starts where it put the run)

    def start(self, step: int) -> None:
        """Before the first step: torchft's --sync groups meet (nothing trained yet: nothing moves;
        a group restarted while the others train waits here and heals at their next meeting)."""
        if self.replicas is not None and self.semi_sync is not None:
            semi_sync = self.semi_sync
            self._meet(lambda: semi_sync.sync(step, start=True))

    def before_step(self, step: int) -> bool:
        """torchft's every-step quorum: True when this group healed in it (the step goes on from
        the peer's position; its quorum is held)."""
        if not self.every_step:
            return False
        replicas = self.replicas
        assert replicas is not None
        return self._meet(lambda: replicas.begin_step(step))

    def after_step(self, step: int, step_samples: int) -> bool:
        """--sync: after every step; True when the groups met after this one."""
        semi_sync = self.semi_sync
        if semi_sync is None:
            return False
        if self.replicas is None:
            return semi_sync.after_step(step)
        self.replicas.trained(step_samples)
        return self._meet(lambda: semi_sync.after_step(step))

    def now(self, step: int) -> None:
        """--sync: the groups meet now, if they have not after this step. An evaluation is of
        one model, and so is the end of a run, whatever step it comes at."""
        if self.semi_sync is not None:
            self.semi_sync.sync(step)

    def snapshot_waits(self, step: int, last: bool) -> bool:
        """--sync: a snapshot asked for after ``step`` waits for the next meeting when the groups'
        weights differ now (``last``: there is none; the snapshot before it stands)."""
        if self.semi_sync is None or self.semi_sync.synced(step):
            self.save_at_sync = False
            return False
        self.save_at_sync = not last
        return True

    def _meet(self, meeting: Callable[[], bool | None]) -> bool:
        began = time.perf_counter()
        met = bool(meeting())
        self._waited(time.perf_counter() - began)
        return met
