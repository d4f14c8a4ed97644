"""A rank that returned is parked by torch's elastic multiprocessing until its launcher reads
every rank's result and sets an event; a stopping launcher never does, so each rank's exit
thread sets it (launch/rank.leave_once_parked). A real forked rank under torch's own
start_processes; the launcher's side is this test, through torch's event."""

import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

from ddptrain.launch.rank import leave_once_parked

ROUNDS = 10  # before the fix, 4 of 5 runs of 5 rounds lost the lock


def returns_at_once() -> str:
    leave_once_parked(grace_s=0.5)
    return "stopped"


def ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow  # 8 s: 10 rounds of a rank parked 0.7 s
def test_a_rank_never_ends_holding_the_lock_of_the_event_its_launcher_and_peers_wait_on(tmp_path):
    """The exit thread was a daemon: when another process's set() had just woken the rank, the
    thread, seeing it still inside wait(), queued for the event's lock behind it; the rank took
    the lock, left, and its process ended at once, while its thread had taken the lock in turn:
    no process ever released it. Every later set() or wait() on the event then hung: a peer rank
    until the launcher's SIGKILL 30 s later (seen twice in full suite runs: a stop signal's job
    ended after 10 s, not 2), a launcher ending normally for ever. Here this test plays the other
    process: it sets the event, holding its lock until the rank's thread has queued, then takes
    the lock once more. The thread now ends before its process does."""
    for round_ in range(ROUNDS):
        ranks = start_processes(f"parked{round_}", returns_at_once, args={0: ()}, envs={0: {}},
                                logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / str(round_))), start_method="fork")
        try:
            time.sleep(0.2)  # the rank returns and parks; its thread lets it be for 0.5 s
            event = ranks._worker_finished_event  # torch's, a multiprocessing.Event: its set() by hand, slowly
            with event._cond:
                event._flag.release()
                event._cond.notify_all()  # the rank wakes and queues for the lock...
                time.sleep(0.5)  # ...its thread, seeing it still inside wait(), behind it
            took = event._cond.acquire(timeout=5)
            if took:
                event._cond.release()
            pid = ranks.pids()[0]
            deadline = time.monotonic() + 5
            while not ended(pid) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert took and ended(pid), f"round {round_}: the event's lock {'free' if took else 'lost'}, " \
                                        f"the rank {'ended' if ended(pid) else 'still parked'} 5 s later"
        finally:
            ranks.close(timeout=1)
