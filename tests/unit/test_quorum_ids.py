"""The ids ddptrain gives torchft's quorums (resilience/replicas.py: _QuorumNamed), in this process
with torchft's own QuorumResult: torchft reconfigures the groups' process group only when a
quorum's id differs from the last one's, so every member must reach the same id, an id must
stay while the quorum goes on, and a restarted lighthouse's quorum must never pass for an old one."""

import pytest

pytest.importorskip("torchft", reason="the ft extra (pip install 'ddptrain[ft]') is not installed")

from torchft._torchft import QuorumResult  # noqa: E402

from ddptrain.resilience.replicas import _QuorumNamed  # noqa: E402

A, B = "group0.job:uuid-a", "group1.job:uuid-b"


def quorum(lighthouse_id: int, step: int, members: list[str], heal: bool = False,
           donor_to: tuple[int, ...] = ()) -> QuorumResult:
    result = QuorumResult()
    result.quorum_id, result.max_step, result.replica_ids = lighthouse_id, step, members
    result.heal, result.recover_dst_replica_ranks = heal, list(donor_to)
    return result


class Lighthouse:
    """What a member's ManagerClient returns: the quorums given, one a call."""

    def __init__(self, *quorums: QuorumResult) -> None:
        self.quorums = list(quorums)

    def _quorum(self, **_: object) -> QuorumResult:
        return self.quorums.pop(0)


def ids(*quorums: QuorumResult) -> list[int]:
    member = _QuorumNamed(Lighthouse(*quorums))
    return [member._quorum().quorum_id for _ in quorums]


def test_a_quorum_that_goes_on_keeps_its_id_step_after_step_and_a_new_one_gets_another():
    steps = ids(quorum(2, 0, [A, B]), quorum(2, 1, [B, A]), quorum(2, 2, [A, B]), quorum(3, 3, [A]),
                quorum(4, 7, [A, B]))
    assert steps[0] == steps[1] == steps[2]  # (no new process group each step: the members' order is torchft's)
    assert len(set(steps[2:])) == 3 and all(0 < i < 2**63 for i in steps)


def test_a_group_frozen_across_a_lighthouse_restart_and_the_group_that_trained_alone_agree_on_a_new_id():
    """Both saw the old lighthouse's quorum 2 at the job's start; the new lighthouse's quorum 1 is
    group 0 alone, which trains to step 30; its quorum 2 has both again, group 1 behind. The id
    torchft sees is the same on both, and new to both: both build the new process group."""
    frozen = ids(quorum(2, 0, [A, B]), quorum(2, 30, [A, B], heal=True))
    alone = ids(quorum(2, 0, [A, B]), quorum(1, 20, [A]), quorum(2, 30, [A, B], donor_to=[1]))
    assert frozen[1] == alone[2]
    assert frozen[1] != frozen[0] and alone[2] not in alone[:2]


def test_every_member_of_a_new_quorum_reaches_the_same_id_whatever_it_saw_before():
    first = ids(quorum(1, 0, [A]), quorum(5, 40, [A, B]))
    second = ids(quorum(3, 12, [B]), quorum(5, 40, [B, A]))
    assert first[1] == second[1]
