"""SemiSync's side of torchft's meetings, in this process: what a group brings, what it does with
the sum it gets back. The meeting here is a scripted stand-in for torchft's groups (the real ones,
at a real lighthouse: tests/integration/test_semi_sync_torchft.py): it sums what this group
brings with what a peer would bring."""

from __future__ import annotations

import torch

from ddptrain.comm import CollectiveMarks
from ddptrain.config import RunConfig
from ddptrain.parallel.semi_sync import SemiSync


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
    return SemiSync(cfg, [weight], CollectiveMarks(), groups=meeting), weight


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
