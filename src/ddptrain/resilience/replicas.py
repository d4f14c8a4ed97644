"""``--fault-tolerance torchft``: this job is one replica group of several, and a group that
fails costs the others a few seconds, not a restart.

Each replica group is a job of its own (``ddptrain train`` or torchrun, ``--replica-group G``
of ``--replica-groups N``); inside it, DDP as always. Across the groups, torchft (PyTorch's
per-step fault tolerance) does the rest, through a lighthouse every group reaches:

- Every step starts by joining the step's quorum (``Manager.start_quorum``): the groups alive
  now. A group that comes back (its launcher restarted it) is in a quorum again within a
  step or two, and first receives the live state of a healthy peer (weights, optimizer,
  where the run stands): it heals, without anyone reading a snapshot.
- The gradients (after DDP's all-reduce inside the group) and the step's loss are averaged
  over the groups of the quorum in one all-reduce of one flat buffer.
- The optimizer steps only when every member agrees the step can be committed
  (``should_commit``); a peer that failed during the step makes it a skipped step for all.

The data is shared over ``N x W`` ranks (group G's rank r reads the share of rank G·W + r),
so with every group present a step trains the samples of one DDP job's step on N·W ranks, and
takes their mean (bitwise that job's with groups of one rank; allclose with more, the sum in
another order). While a group is missing, a step is the mean over the groups present, and
the samples the missing groups would have trained are counted (``samples_skipped``).

torchft's own DDP wrapper is not used: when a peer dies during its all-reduce on gloo it
ends the surviving group too (``assert fut._fut``); ``Manager.allreduce`` survives that.
``use_async_quorum=False``: a heal is applied inside ``start_quorum``, before the step's
forward, so the loop re-enters the epoch where the healed state stands.

A group that resumes after the others took the job's last step (its launcher restarted it
late) has nobody to heal from: the lighthouse's last quorum says the job ended, and the group
says so in one line and trains nothing (alone it would train a model of its own). Replica ids
carry a hash of the job's math settings, so another job's quorum on the same lighthouse is
never taken for this one's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import socket
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ReduceOp

from ..comm import DistContext, broadcast_object
from ..errors import ConfigError, LighthouseLost
from ..settings import ResilienceSettings
from .lighthouse import LIGHTHOUSE_CHECK_S, LighthouseWatch, lighthouse_address, quiet_torchft, read_dashboard
from .siblings import SiblingWatch

# The lighthouse's dashboard, /status: a member of the last quorum and the step it joined for
QUORUM_MEMBER = re.compile(r"<b>(group\d+\.[0-9a-f]+):[^<]*</b>\s*<br/>\s*Step:\s*(\d+)")
RESUMED_WAIT_S = 60.0  # a resumed start's wait for the other groups (a whole-job restart's are not far behind)
QUORUM_RETRY_S = 1.0  # while the lighthouse is away, how often a group asks it (or a new one) again


def torchft_logs_to(path: Path) -> None:
    """torchft's Python log lines go to this rank's log file, not the console: on CPU each start
    warns that NCCL's flight recorder cannot be reset, and each failure prints torchft's traceback
    on every healthy rank. ddptrain says in a line what happened (a group left, a heal)."""
    logger = logging.getLogger("torchft")
    if any(getattr(handler, "baseFilename", None) == str(path) for handler in logger.handlers):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def data_context(resilience: ResilienceSettings, ctx: DistContext) -> DistContext:
    """The rank and world the training data is shared over: group G's rank r reads rank
    G·W + r's share of N·W."""
    torchft = resilience.fault_tolerance == "torchft"
    groups = resilience.replica_groups if torchft else 1
    group = resilience.replica_group if torchft else 0
    return dataclasses.replace(ctx, rank=group * ctx.world_size + ctx.rank, world_size=groups * ctx.world_size)


class _QuorumNamed:
    """torchft's ManagerClient, each quorum it returns renamed so that no two quorums share an id.

    torchft takes a quorum whose id equals the last one's for the same quorum: it neither
    reconfigures the groups' process group nor picks new store keys (``torchft/<quorum id>/``).
    A lighthouse restarted mid-run numbers its quorums from 1 again, so a group that had lived
    through the old lighthouse's quorum 2 (the job's start: one group, then both) met the new
    one's quorum 2 (one group alone at the new lighthouse, then both), kept its old process
    group and failed its heal in PGTransport's ``recv`` ("Connection closed by peer": the peer
    had reconfigured), while the peer waited for it in the new group's rendezvous until
    --timeout (reproduced here: one group SIGSTOPped across a lighthouse restart). Earlier, a
    group found the old quorum's store keys and hung in the rendezvous.

    The lighthouse keeps an id while its members stay: so does this, and a quorum with a new
    lighthouse id, new members, or a member behind the others (a heal: never so in a quorum
    that goes on) gets a new id, a digest of the lighthouse's id, the step and the members
    (their ids carry a uuid of each process), the same on every member."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._seen: tuple[int, list[str]] | None = None  # the last quorum's lighthouse id and members
        self._id = -1  # and the id given to it

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        seen = (quorum.quorum_id, sorted(quorum.replica_ids))
        behind = quorum.heal or bool(quorum.recover_dst_replica_ranks)
        if seen != self._seen or behind:
            self._seen, self._id = seen, quorum_id(quorum.quorum_id, quorum.max_step, quorum.replica_ids)
        quorum.quorum_id = self._id
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def quorum_id(lighthouse_id: int, max_step: int, replica_ids: list[str]) -> int:
    """A new quorum's id for torchft: a digest of the lighthouse's id, the step and the members,
    the same on every member (a positive 60-bit integer: torchft keeps it as an i64)."""
    seen = f"{lighthouse_id}|{max_step}|{','.join(sorted(replica_ids))}"
    return int(hashlib.sha256(seen.encode()).hexdigest()[:15], 16) + 1


class ReplicaGroups:
    """This rank's part in the groups' per-step agreement (torchft's Manager)."""

    def __init__(self, resilience: ResilienceSettings, fingerprint: dict[str, Any], run_dir: Path, ctx: DistContext,
                 state_dict: Callable[[], dict[str, Any]], load_state_dict: Callable[[dict[str, Any]], None],
                 info: Callable[[str], None]) -> None:
        """``fingerprint``: the run's math settings (RunConfig.math_fingerprint): only groups that share
        them meet; ``run_dir``: the run dir's folder on this machine (its logs/ and pids/)."""
        quiet_torchft()
        torchft_logs_to(run_dir / "logs" / f"rank-{ctx.rank}.torchft")
        from torchft.process_group import ProcessGroupGloo

        # torchft's PGTransport reads the received state with torch.frombuffer and torch's pytree
        # in a form torch 2.13 deprecates: both warnings are torchft's, printed on every heal
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        warnings.filterwarnings("ignore", "`isinstance\\(treespec, LeafSpec\\)` is deprecated", FutureWarning)

        self.groups, self.group, self.info = resilience.replica_groups, resilience.replica_group, info
        self.is_main = ctx.is_main
        self.address = lighthouse_address(resilience.lighthouse)
        settings = json.dumps(fingerprint, sort_keys=True, default=str)
        self.replica_id = f"group{self.group}.{hashlib.sha256(settings.encode()).hexdigest()[:8]}"
        self._load_state = load_state_dict
        self.timeout_s = resilience.timeout
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=self.timeout_s))
        address = self.address
        try:
            self.manager = self._manager(ctx, state_dict, address)
            self.manager._client = _QuorumNamed(self.manager._client)
        except RuntimeError as error:
            if "failed to connect" not in str(error):
                raise
            raise ConfigError(f"--lighthouse {address}: no lighthouse answers there; start one (ddptrain "
                              "lighthouse) or give its address") from None
        self.present = self.groups  # how many groups the newest quorum holds
        self.members = set(range(self.groups))  # which: as the newest step's all-reduce found them
        self.started = False
        self.in_step = False  # a quorum is held for the next step (joined, not yet committed)
        self.healed = False
        self.committed = True  # the last step was taken by every member
        self.samples_skipped = 0
        self.unmet_samples = 0  # --sync local-sgd|diloco: the samples trained since the groups last met
        self.watch = LighthouseWatch(self.address, info, self.timeout_s) if ctx.is_main else None
        # (every rank wrote its pid file before the process group formed)
        self.siblings = SiblingWatch(run_dir / "pids", ctx.rank) if ctx.world_size > 1 else None

    def _manager(self, ctx: DistContext, state_dict: Callable[[], dict[str, Any]], address: str) -> Any:
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.manager import Manager

        timeout = timedelta(seconds=self.timeout_s)
        return Manager(
            pg=self.pg, load_state_dict=self._healed, state_dict=state_dict, min_replica_size=1,
            use_async_quorum=False, replica_id=self.replica_id, lighthouse_addr=address,
            rank=ctx.rank, world_size=ctx.world_size, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timedelta(seconds=30),
            # torchft gives up on a quorum at once when the lighthouse is gone (and the quorum then
            # hangs until --timeout): asked again every QUORUM_RETRY_S, reconnecting each time, a
            # group finds a lighthouse restarted on the address and trains on
            quorum_retries=max(1, round(self.timeout_s / QUORUM_RETRY_S)),
            # a recovering group receives the live state through the groups' own process group
            checkpoint_transport=PGTransport(self.pg, timeout=timeout, device=ctx.device),
            init_sync=False,  # ddptrain seeds the initial weights: every group starts with the same
            hostname=os.environ.get("DDPTRAIN_FT_HOST") or socket.gethostname())

    def ended_without_us(self, resumed_at: int, last_step: int) -> bool:
        """Collective, before this group's first quorum: whether the other groups took the job's
        last step (``last_step``) while this group was away (it stands at ``resumed_at``). Rank 0
        asks the lighthouse and says so in one line; the group's ranks agree."""
        line = self._ended_line(resumed_at, last_step) if self.is_main else None
        if line:
            self.info(f"ddptrain: {line}")
        return bool(broadcast_object(line))

    def _ended_line(self, resumed_at: int, last_step: int) -> str | None:
        """The line that says the job ended, when the lighthouse's last quorum is this job's other
        groups taking its last step; None otherwise, or when the dashboard cannot tell (then the
        group joins and waits as always)."""
        try:
            status = read_dashboard(self.address, "/status", timeout_s=LIGHTHOUSE_CHECK_S)
        except (OSError, ValueError):
            return None
        job = self.replica_id.split(".", 1)[1]
        others = {int(step) for member, step in QUORUM_MEMBER.findall(status.split("Previous Quorum", 1)[-1])
                  if member.endswith("." + job) and member != self.replica_id}
        if not others or min(others) + 1 < last_step or resumed_at >= last_step:
            return None
        return (f"the other replica groups finished this job (the lighthouse's last quorum took step {last_step}) "
                f"while replica group {self.group} stood at step {resumed_at}: nothing left to train here; the job's "
                "model is in their run dirs")

    def _healed(self, state: dict[str, Any]) -> None:
        self._load_state(state)
        self.healed = True

    def begin_step(self, step: int) -> bool:
        """Join the quorum of the step after ``step`` (once: a quorum held from the end of an
        epoch, or from a heal, is that step's); True when this group healed from a peer (its
        state is the peer's now: the loop re-enters the epoch where it stands, and takes the
        step with the others)."""
        self.healed = False
        if self.in_step:
            return False
        self.in_step = True
        self._join(step)
        return self.healed

    def _join(self, step: int) -> None:
        """Join the quorum after ``step``; at the job's start, wait for every group."""
        # torchft's step is ddptrain's: the group furthest on (after a whole-job restart from
        # snapshots of different steps too) is the one the others heal from
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        self._quorum(step)
        if not self.started and not self.healed:  # (a group that healed found the others)
            self._wait_for_every_group(resumed=step > 0)
        self.started = True
        self.present = self.manager.num_participants()
        if self.healed:  # (the step it trains first with the others)
            self.info(f"step {self.manager.current_step() + 1}: replica group {self.group} rejoined from a live peer "
                      f"({self.present} of {self.groups} groups train)")

    def _wait_for_every_group(self, resumed: bool) -> None:
        """The job's start: no group trains before every group is in the quorum. A group that
        started early would otherwise train alone, and the others heal from it; after a
        whole-job restart (snapshots of different steps) that could be the group whose snapshot
        is the oldest, and the steps the others had taken since would be lost. A fresh start
        waits up to --timeout, then fails; a resumed one up to RESUMED_WAIT_S, then trains on
        with the groups there (the others may have finished, or be gone for good: they heal from
        it when they come). A group restarted alone while the others train heals in its first
        quorum and does not wait."""
        wait_s = min(self.timeout_s, RESUMED_WAIT_S) if resumed else self.timeout_s
        deadline = time.monotonic() + wait_s
        while self.manager.num_participants() < self.groups:
            if time.monotonic() > deadline and resumed:
                self.info(f"ddptrain: only {self.manager.num_participants()} of {self.groups} replica groups reached "
                          f"the lighthouse within {wait_s:g} s of this resumed start; training on with them (the "
                          "others heal from them when they come)")
                return
            if time.monotonic() > deadline:
                raise ConfigError(f"only {self.manager.num_participants()} of --replica-groups {self.groups} "
                                  f"replica groups reached the lighthouse within --timeout {self.timeout_s:g} s; "
                                  "start every group with the same --lighthouse, or lower --replica-groups")
            time.sleep(0.1)
            self._quorum(step=-1)

    def _quorum(self, step: int) -> None:
        """Join the quorum of the step after ``step`` (-1: the start's wait for every group)."""
        if self.watch is not None:
            self.watch.pending(step)
        try:
            self.manager.start_quorum()
        except TimeoutError as error:
            try:  # (a quorum that timed out with the lighthouse answering is torchft's to tell)
                read_dashboard(self.address, timeout_s=LIGHTHOUSE_CHECK_S)
            except (OSError, ValueError):
                raise LighthouseLost(
                    f"the lighthouse at {self.address} did not answer for --timeout {self.timeout_s:g} s; start it "
                    "again on its address (under a supervisor, it comes back by itself: docs/fault-tolerance.md) and "
                    "run the same command to resume") from None
            raise error
        finally:
            if self.watch is not None:
                self.watch.settled()

    def average(self, gradients: list[torch.Tensor], loss: torch.Tensor, step: int) -> torch.Tensor:
        """The gradients and the loss of step ``step``, averaged over the groups of the quorum
        in place (one all-reduce of one flat buffer, which also carries a slot per group: each
        group sets its own, so the mean says which groups took part); returns the loss."""
        dtype = gradients[0].dtype if gradients else loss.dtype
        member = torch.zeros(self.groups, dtype=dtype, device=loss.device)
        member[self.group] = 1.0
        flat = torch.cat([g.reshape(-1) for g in gradients] + [loss.detach().reshape(1).to(dtype), member])
        self.manager.allreduce(flat).wait()
        if self.manager.errored() is not None:  # a peer failed in it: the buffer means nothing, the
            return loss  # step is not taken (commit), and this group's own loss is the record's
        offset = 0
        for gradient in gradients:
            n = gradient.numel()
            gradient.copy_(flat[offset:offset + n].view_as(gradient))
            offset += n
        self._note_members({g for g, share in enumerate(flat[offset + 1:].tolist()) if share > 0}, step)
        return flat[offset].to(loss.dtype)

    def _note_members(self, members: set[int], step: int) -> None:
        """One line per group that left or joined since the previous step."""
        if not members or members == self.members:  # (none: this step's all-reduce failed)
            return
        for group in sorted(self.members - members):
            self.info(f"step {step}: replica group {group} left; {len(members)} of {self.groups} groups train on")
        for group in sorted(members - self.members - {self.group}):
            self.info(f"step {step}: replica group {group} joined; {len(members)} of {self.groups} groups train")
        self.members = members

    def commit(self, step: int, step_samples: int) -> bool:
        """Whether step ``step`` may be taken (every member agrees); counts what missing groups
        would have trained (``step_samples``: the step's samples over all N groups)."""
        committed = self.committed = bool(self.manager.should_commit())
        self.in_step = False
        if not committed:
            self.info(f"step {step}: not taken (a replica group failed during it); its samples are skipped")
        present = self.present if committed else 0
        self.samples_skipped += step_samples * (self.groups - present) // self.groups
        return committed

    # --- --sync local-sgd | diloco: the groups meet every --sync-every steps, not every step -------
    def trained(self, step_samples: int) -> None:
        """A step taken between two meetings (``step_samples``: its samples over all N groups)."""
        self.unmet_samples += step_samples

    def meet(self, step: int,
             contribution: Callable[[bool], tuple[torch.Tensor, bool]]) -> tuple[torch.Tensor, int] | None:
        """The groups' meeting after ``step`` under --sync local-sgd|diloco: the quorum (a group
        behind heals in it from a live peer), then one all-reduce, a sum, of what each group
        brings, ``contribution(healed)``: a flat tensor, and whether it counts (a group that
        healed brings zeros: its state is the peer's, whose change would count twice). Returns the
        sum and how many groups it counts, or None when the meeting is not committed (a group
        failed in it: every group then goes back to the last synced weights)."""
        self.healed = False
        self._join(step)
        flat, counts = contribution(self.healed)
        slots = torch.zeros(self.groups + 1, dtype=flat.dtype, device=flat.device)
        slots[self.group], slots[-1] = 1.0, float(counts)  # present; counted
        total = torch.cat([flat, slots])
        self.manager.allreduce(total, reduce_op=ReduceOp.SUM).wait()
        committed = bool(self.manager.should_commit())
        unmet, self.unmet_samples = self.unmet_samples, 0
        if not committed:
            self.info(f"step {step}: the replica groups' sync was not taken (a group failed during it); every group "
                      "goes back to the weights of the sync before, and the steps since are skipped")
            self.samples_skipped += unmet
            return None
        counted = round(total[-1].item())
        self._note_members({g for g, share in enumerate(total[flat.numel():-1].tolist()) if share > 0}, step)
        self.samples_skipped += unmet * (self.groups - counted) // self.groups
        return total[:flat.numel()], counted

    def state_dict(self) -> dict[str, Any]:
        # (the samples since the last meeting: a live peer's, given in a heal; a snapshot, taken at a meeting, has none)
        return {"samples_skipped": self.samples_skipped, **({"unmet_samples": self.unmet_samples}
                                                             if self.unmet_samples else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples_skipped = int(state.get("samples_skipped", 0))
        self.unmet_samples = int(state.get("unmet_samples", 0))

    def close(self) -> None:
        for watch in (self.watch, self.siblings):
            if watch is not None:
                watch.close()
        self.manager.shutdown(wait=False)
