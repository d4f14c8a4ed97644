"""SemiSync's side of torchft's meetings, in this process: what a group brings, what it does with
the sum it gets back. The meeting here is a scripted stand-in for torchft's groups (the real ones,
at a real lighthouse: tests/integration/test_semi_sync_torchft.py): it sums what this group
brings with what a peer would bring."""

from __future__ import annotations

import torch

from ddptrain.comm import CollectiveMarks
from ddptrain.parallel.semi_sync import SemiSync
from ddptrain.settings import RunConfig


class Meeting:
    """Another group brings ``peer`` (a flat pseudo-gradient, or None: it healed); ``healed``:
    this group heals in the meeting; ``committed``: False, a group failed in it."""

    def __init__(self, peer: torch.Tensor | None, healed: bool = False, committed: bool = True) -> None:
        self.peer, self.healed, self.committed = peer, healed, committed
        self.brought: tuple[torch.Tensor, bool] | None = None

    def meet(self, step, contribution):
        flat, counts = contribution(self.healed)
        self.brought = (flat.clone(), counts)
        if not self.committed:
            return None
        peer = torch.zeros_like(flat) if self.peer is None else self.peer
        return flat + peer, int(counts) + int(self.peer is not None)


def _sync(meeting: Meeting, kind: str = "diloco", **options) -> tuple[SemiSync, torch.nn.Parameter]:
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    cfg = RunConfig(sync=kind, sync_every=2, fault_tolerance="torchft", replica_groups=2, **options)
    return SemiSync(cfg.parallel, [weight], CollectiveMarks(), groups=meeting), weight


def _train(weight: torch.nn.Parameter, change: list[float]) -> None:
    with torch.no_grad():
        weight.sub_(torch.tensor(change))


def test_a_meeting_steps_the_anchor_by_the_mean_of_the_groups_that_trained():
    meeting = Meeting(peer=torch.tensor([0.3, 0.1]))
    sync, weight = _sync(meeting, outer_lr=1.0, outer_momentum=0.0)
    _train(weight, [0.1, 0.3])
    assert sync.after_step(1) is False and meeting.brought is None  # between meetings: nothing
    assert sync.after_step(2) is True
    assert meeting.brought[1] and torch.allclose(meeting.brought[0], torch.tensor([0.1, 0.3]))
    assert torch.allclose(weight.detach(), torch.tensor([0.8, 1.8]))  # 1 - 0.2, 2 - 0.2
    assert sync.synced(2) and "anchor" not in sync.state_dict()  # a snapshot here holds no anchor


def test_the_first_meeting_brings_nothing_and_moves_nothing_even_with_momentum():
    meeting = Meeting(peer=None)
    sync, weight = _sync(meeting)  # the paper's outer step: Nesterov momentum 0.9
    sync.outer.state[sync.anchor[0]] = {"momentum_buffer": torch.tensor([0.5, 0.5])}  # a resumed run's
    sync.sync(0, start=True)
    assert meeting.brought[1] is False and not meeting.brought[0].any()
    assert torch.equal(weight.detach(), torch.tensor([1.0, 2.0]))


def test_a_group_that_healed_brings_zeros_and_takes_the_peers_step():
    meeting = Meeting(peer=torch.tensor([0.2, 0.2]), healed=True)
    sync, weight = _sync(meeting, outer_lr=0.5, outer_momentum=0.0)
    _train(weight, [1.0, 1.0])  # (a heal would have loaded a peer's state here)
    sync.after_step(2)
    assert meeting.brought[1] is False and not meeting.brought[0].any()
    assert torch.allclose(weight.detach(), torch.tensor([0.9, 1.9]))  # the anchor by 0.5 x the peer's 0.2


def test_a_meeting_not_committed_takes_the_group_back_to_the_last_synced_weights():
    meeting = Meeting(peer=torch.tensor([0.3, 0.1]), committed=False)
    sync, weight = _sync(meeting)
    _train(weight, [0.1, 0.3])
    sync.after_step(2)
    assert torch.equal(weight.detach(), torch.tensor([1.0, 2.0])) and sync.synced(2)


def test_a_live_peers_state_between_meetings_carries_its_anchor():
    sync, weight = _sync(Meeting(peer=None), kind="local-sgd")
    _train(weight, [0.5, 0.5])
    sync.after_step(1)
    state = sync.state_dict()
    assert state["step"] == 1 and state["synced_step"] == 0
    assert torch.equal(state["anchor"][0], torch.tensor([1.0, 2.0]))
    other, other_weight = _sync(Meeting(peer=None), kind="local-sgd")
    with torch.no_grad():
        other_weight.copy_(weight)  # the heal's weights, then its states
    other.load_state_dict(state)
    assert torch.equal(other.anchor[0].detach(), torch.tensor([1.0, 2.0])) and not other.synced(1)


class Groups:
    """torchft's replica groups as the loop's GroupSync uses them: what each step trained, and a
    quorum before a step that may heal this group."""

    def __init__(self, heals_at: int | None = None) -> None:
        self.heals_at, self.healed, self.trained_samples = heals_at, False, 0

    def trained(self, step_samples: int) -> None:
        self.trained_samples += step_samples

    def begin_step(self, step: int) -> bool:
        self.healed = step == self.heals_at
        return self.healed


def test_the_loop_meets_nobody_with_one_group():
    from ddptrain.group_sync import GroupSync

    waits: list[float] = []
    groups = GroupSync(None, None, waits.append)
    groups.start(0)
    groups.epoch_started()
    assert not groups.before_step(0) and not groups.after_step(1, 8) and not groups.healed
    groups.now(1)
    assert not groups.snapshot_waits(1, last=False) and not groups.save_at_sync
    assert waits == []  # nothing met, no time counted as waiting


def test_the_loop_meets_every_sync_every_steps_and_a_snapshot_between_waits_for_the_next():
    from ddptrain.group_sync import GroupSync

    meeting, replicas, waits = Meeting(peer=torch.zeros(2)), Groups(), []
    semi_sync, weight = _sync(meeting)  # --sync-every 2
    groups = GroupSync(replicas, semi_sync, waits.append)
    groups.start(0)  # before the first step: the groups meet (nothing trained moves nothing)
    assert meeting.brought is not None and len(waits) == 1
    assert not groups.before_step(0)  # (--sync: no quorum before each step)
    _train(weight, [0.5, 0.5])
    assert not groups.after_step(1, 8) and len(waits) == 2  # a step that ends between meetings
    assert groups.snapshot_waits(1, last=False) and groups.save_at_sync  # taken at the next meeting
    _train(weight, [0.5, 0.5])
    assert groups.after_step(2, 8) and replicas.trained_samples == 16
    assert not groups.snapshot_waits(2, last=False) and not groups.save_at_sync  # the groups are one model
    # a stop signal between meetings (last): no snapshot now, nor one later; the one at step 2 stands
    assert groups.snapshot_waits(3, last=True) and not groups.save_at_sync


def test_torchfts_every_step_quorum_is_before_each_step_and_counts_as_waiting():
    from ddptrain.group_sync import GroupSync

    replicas, waits = Groups(heals_at=5), []
    groups = GroupSync(replicas, None, waits.append)
    assert not groups.before_step(4) and not groups.healed
    assert groups.before_step(5) and groups.healed  # healed: the step goes on from the peer's position
    groups.epoch_started()
    assert not groups.healed and len(waits) == 2
    assert not groups.after_step(5, 8) and replicas.trained_samples == 0  # the gradients met inside the step
