"""The failure report's choice of the rank to blame, from the ranks' error files' contents."""

from ddptrain.resilience.failures import RankError, root_cause


def _error(rank: int, kind: str, text: str, mtime: int) -> RankError:
    return RankError(rank, mtime, f"{kind}: {text}", "Traceback ...")


def test_root_cause_prefers_the_real_error_over_the_ranks_that_only_felt_it():
    closed = "[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:4242"
    errors = {0: _error(0, "RuntimeError", closed, 1), 1: _error(1, "ValueError", "bad sample", 2),
              2: _error(2, "PeerFailed", "rank 2 stopped because rank 1 failed: ValueError", 0)}
    assert root_cause(errors, killed={}).rank == 1
    # a rank killed by a signal leaves no report: it explains the others' lost connections
    assert root_cause({0: errors[0]}, killed={1: "SIGKILL"}) == 1
    assert root_cause({0: errors[0]}, killed={}).rank == 0
    # the launcher terminated rank 0 (after rank 1 ended) before rank 0 heard of the failure
    terminated = _error(0, "SignalException", "Process 4242 got signal: 15", 0)
    assert root_cause({0: terminated, 1: errors[1]}, killed={}).rank == 1
    assert root_cause({0: terminated}, killed={}).rank == 0
