"""The watchdog's judgement and its report as pure functions; its store calls against a real
store in this process; its silence check in a process of its own (it ends its process)."""

import time
from pathlib import Path

import pytest

from ddptrain.resilience.board import Heartbeat
from ddptrain.resilience.hangs import hang_summary, judge_hang

TIMEOUT = 10.0


class Counted:
    """A store client that counts the requests made through it."""

    def __init__(self, store):
        self.store, self.requests = store, 0

    def __getattr__(self, name):
        self.requests += 1
        return getattr(self.store, name)


def beat(arrivals: int, inside: bool, where: str = "the gradient all-reduce (step 7)") -> Heartbeat:
    return Heartbeat(arrivals, inside, where)


def test_a_heartbeat_survives_its_trip_through_the_store_even_with_bars_in_the_label():
    sent = beat(12, True, "a | strange | label (step 3)")
    assert Heartbeat.decode(sent.encode()) == sent


def test_no_verdict_before_a_rank_has_waited_the_timeout():
    seen = {0: (beat(7, True), 100.0), 1: (beat(6, False), 100.0)}
    assert judge_hang(seen, now=100.0 + TIMEOUT - 0.1, timeout_s=TIMEOUT) is None
    assert judge_hang({0: (beat(7, False), 0.0), 1: (beat(7, False), 0.0)}, now=1e6, timeout_s=TIMEOUT) is None


def test_the_rank_that_never_arrived_is_the_culprit_and_the_waiting_rank_is_not_blamed():
    seen = {0: (beat(7, True), 0.0), 1: (beat(6, False, "data loading"), 0.0)}
    verdict = judge_hang(seen, now=TIMEOUT + 1, timeout_s=TIMEOUT)
    assert verdict is not None
    assert verdict["culprits"] == [1] and verdict["waiting"] == [0]
    assert verdict["label"] == "the gradient all-reduce (step 7)"


def test_a_rank_that_never_published_or_stands_outside_the_same_collective_is_a_culprit():
    seen = {0: (beat(7, True), 0.0), 1: (None, 0.0), 2: (beat(7, False), 0.0), 3: (beat(7, True), 0.0)}
    verdict = judge_hang(seen, now=TIMEOUT + 1, timeout_s=TIMEOUT)
    assert verdict["culprits"] == [1, 2] and verdict["waiting"] == [0, 3]


def test_when_every_rank_waits_in_the_same_collective_nobody_is_blamed():
    seen = {0: (beat(7, True), 0.0), 1: (beat(7, True), 0.0)}
    verdict = judge_hang(seen, now=TIMEOUT + 1, timeout_s=TIMEOUT)
    assert verdict["culprits"] == []
    text = hang_summary(verdict, {}, TIMEOUT, None)
    assert text.startswith("ddptrain: every rank waits in the gradient all-reduce (step 7) for more than "
                           "--timeout 10 s")


def test_the_summary_names_the_culprits_with_their_frames_and_says_who_did_not_answer():
    verdict = {"culprits": [1, 2], "waiting": [0], "label": "the gradient all-reduce (step 7)"}
    stacks = {1: '  File "x.py", line 3, in wait_for_ever', 2: None}
    text = hang_summary(verdict, stacks, TIMEOUT, Path("run/logs/stacks"))
    assert text.splitlines() == [
        "ddptrain: rank 1, 2 did not reach the gradient all-reduce (step 7) within --timeout 10 s; "
        "rank 0 waited there.",
        "ddptrain: rank 1 was in (innermost call last):",
        '  File "x.py", line 3, in wait_for_ever',
        "ddptrain: rank 2 did not answer: it never started, or its Python interpreter is blocked",
        "ddptrain: every rank's stack: run/logs/stacks",
    ]


def test_heartbeats_are_a_twentieth_of_the_timeout_between_the_verdict_period_and_five_seconds():
    from ddptrain.resilience.watchdog import PERIOD_S, beat_period

    assert beat_period(300.0) == 5.0 and beat_period(60.0) == 3.0  # the default --timeout: a tenth of the load
    assert beat_period(4.0) == PERIOD_S and beat_period(3600.0) == 5.0  # tests' short timeouts; never slower


def test_heartbeats_slow_down_in_proportion_to_the_ranks_beyond_1024_but_stay_within_a_quarter_of_the_timeout():
    from ddptrain.resilience.watchdog import PERIOD_S, beat_period

    assert beat_period(5.0, 2) == beat_period(5.0, 1024) == PERIOD_S  # every job of this suite: as before
    assert beat_period(10.0, 2048) == 1.0 and beat_period(10.0, 4096) == 2.0  # 2,048 heartbeats a second at most
    for ranks in (1024, 2048, 4096):
        assert ranks / beat_period(10.0, ranks) == 1024 / PERIOD_S
    # A heartbeat the judge reads up to two periods late must not look older than --timeout.
    assert beat_period(5.0, 4096) == beat_period(5.0, 65536) == 1.25  # not 2 s, not 5 s
    assert beat_period(300.0, 4096) == beat_period(300.0, 2) == 5.0
    for timeout in (2.0, 5.0, 10.0, 60.0, 300.0):
        for ranks in (2, 1024, 4096, 65536):
            period = beat_period(timeout, ranks)
            assert period <= max(timeout / 4, PERIOD_S) and period >= beat_period(timeout, 2)


def test_verdict_polls_slow_down_in_proportion_to_the_ranks_beyond_1024_and_never_past_2_s():
    from ddptrain.resilience.watchdog import PERIOD_S, verdict_period

    assert verdict_period(2) == verdict_period(1024) == PERIOD_S  # every job of this suite: a failure ends all in 0.5 s
    assert verdict_period(2048) == 1.0 and verdict_period(4096) == verdict_period(16384) == 2.0


def test_a_store_unanswered_for_the_timeout_between_10_and_30_s_counts_as_lost():
    from ddptrain.resilience.watchdog import store_silent_s

    assert store_silent_s(300.0) == 30.0 and store_silent_s(20.0) == 20.0  # the default: half a minute
    assert store_silent_s(4.0) == 10.0  # a short --timeout never mistakes a busy store for a lost one


def test_a_stores_first_answer_may_take_longer_in_proportion_to_the_ranks_beyond_1024():
    """The first round meets every rank's connection: at 4,096 ranks 10 s was too short for it."""
    from ddptrain.resilience.watchdog import store_silent_s

    for timeout in (4.0, 20.0, 300.0):
        assert store_silent_s(timeout, 2, answered=False) == store_silent_s(timeout, 1024, answered=False) \
            == store_silent_s(timeout)  # every job of this suite: unchanged
        assert store_silent_s(timeout, 4096, answered=False) == 4 * store_silent_s(timeout)
        assert store_silent_s(timeout, 4096, answered=True) == store_silent_s(timeout)  # then flat, as the load
    assert store_silent_s(5.0, 4096, answered=False) == 40.0


def test_rank_0_reads_every_heartbeat_in_two_store_requests_however_many_ranks_have_not_started():
    """At 4,096 ranks starting up, a read that checked each missing rank's key cost rank 0 two
    requests per rank not yet started, every period; some ranks never got connected."""
    import torch.distributed as dist

    from ddptrain import free_port
    from ddptrain.resilience.board import Board, Heartbeat

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)  # noqa: F841 - serves the boards
    boards = [Board("127.0.0.1", port, rank, 1000) for rank in (0, 7)]

    counted = boards[0].store = Counted(boards[0].store)
    assert set(boards[0].heartbeats().values()) == {None} and counted.requests == 1  # nobody published yet
    boards[1].publish(Heartbeat(3, True, "the gradient all-reduce (step 2)"))
    boards[1].publish(Heartbeat(4, True, "the gradient all-reduce (step 3)"))  # listed once
    counted.requests = 0
    beats = boards[0].heartbeats()
    assert counted.requests == 2 and len(beats) == 1000
    assert beats[7] == Heartbeat(4, True, "the gradient all-reduce (step 3)")
    assert [rank for rank, beat in beats.items() if beat is not None] == [7]


def test_a_still_rank_reads_the_flight_recorder_once_a_heartbeat_not_once_a_period(monkeypatch):
    """A rank that does not move (a long load, a hang) reads the recorder (about a millisecond
    with its buffer full) for the heartbeats it publishes: at --timeout 300, every 5 s, not every
    0.5 s; here a 0.2 s heartbeat on 0.05 s periods."""
    import torch.distributed as dist

    from ddptrain import free_port
    from ddptrain.resilience import watchdog

    reads = []
    monkeypatch.setattr(watchdog, "in_flight", lambda: reads.append(time.monotonic()))
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)  # noqa: F841 - serves the board
    env = type("Env", (), {"rank": 1, "world_size": 2, "master_addr": "127.0.0.1", "master_port": port})
    dog = watchdog.Watchdog(env, 4.0, run_dir=None, period_s=0.05)
    assert dog.beat_period_s == pytest.approx(0.2)
    dog.start()
    time.sleep(1.5)  # 30 periods, 7 heartbeats
    dog.finished.set()
    dog.thread.join(timeout=5)
    assert 3 <= len(reads) <= 9, reads


def test_beyond_1024_ranks_the_thread_sleeps_until_a_heartbeat_or_a_poll_is_due_not_every_period():
    """At 4,096 ranks the heartbeats and verdict polls come less often than a period: the
    thread wakes for them alone (at 256 simulated ranks a process, every wake-up contends for
    one interpreter lock; control_plane_startup.py). Periods of 0.05 s here: a heartbeat every
    0.25 s, a poll every 0.2 s; the store-silence thread wakes once a second."""
    import threading

    import torch.distributed as dist

    from ddptrain import free_port
    from ddptrain.resilience import watchdog

    class CountedEvent(threading.Event):
        waits = 0

        def wait(self, timeout=None):
            CountedEvent.waits += 1
            return super().wait(timeout)

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)  # noqa: F841 - serves the board
    env = type("Env", (), {"rank": 1, "world_size": 4096, "master_addr": "127.0.0.1", "master_port": port})
    dog = watchdog.Watchdog(env, 5.0, run_dir=None, period_s=0.05)
    assert (dog.beat_period_s, dog.verdict_period_s) == (pytest.approx(0.25), pytest.approx(0.2))
    dog.finished = CountedEvent()
    dog.start()
    time.sleep(2.0)  # every period: 40 wake-ups and 2; when due: about 18 and 2
    dog.finished.set()
    dog.thread.join(timeout=5)
    assert 8 <= CountedEvent.waits <= 26, CountedEvent.waits


def test_rank_0_reads_the_ranks_stacks_in_a_request_per_poll_however_many_are_missing():
    """After a hang at 4,096 ranks with a few silent, a read that checked each missing rank's
    key made 8,000 round trips."""
    import torch.distributed as dist

    from ddptrain import free_port
    from ddptrain.resilience.board import Board

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)  # noqa: F841 - serves the boards
    boards = [Board("127.0.0.1", port, rank, 1000) for rank in (0, 7, 9)]
    boards[1].post_stack("  rank 7's frames")
    boards[2].post_stack("  rank 9's frames")
    counted = boards[0].store = Counted(boards[0].store)
    assert boards[0].stacks([7, 9], wait_s=5) == {7: "  rank 7's frames", 9: "  rank 9's frames"}
    assert counted.requests == 3  # the list made if missing, read once, the stacks
    counted.requests = 0
    started = time.monotonic()
    stacks = boards[0].stacks(list(range(1000)), wait_s=0.3)  # 998 ranks never answer
    assert time.monotonic() - started < 5 and counted.requests < 30
    assert stacks[7] == "  rank 7's frames" and stacks[9] == "  rank 9's frames"
    assert sum(text is None for text in stacks.values()) == 998


def test_the_store_probe_tells_a_live_store_from_one_that_accepts_and_never_answers_and_from_none():
    """torch's client waits for ever for a server that accepts and never answers (a frozen
    host): the probe answers False within its wait even then."""
    import os
    import socket

    import torch.distributed as dist

    from ddptrain import free_port
    from ddptrain.resilience.board import store_answers

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)  # noqa: F841 - it answers
    silent = socket.create_server(("127.0.0.1", 0))  # its backlog accepts; nobody ever reads or answers
    # Open until this process ends (a descriptor never closed, past the interpreter's shutdown): the
    # probe's thread, left behind, waits on it without a word; closed, torch's client logs its retry.
    os.dup(silent.fileno())
    started = time.monotonic()
    assert store_answers("127.0.0.1", port, 2.0) and time.monotonic() - started < 2
    started = time.monotonic()
    assert not store_answers("127.0.0.1", silent.getsockname()[1], 1.0)
    assert not store_answers("127.0.0.1", free_port(), 1.0)  # nobody listens
    assert time.monotonic() - started < 4



SILENT_CALL = """
import sys, threading, time
from types import SimpleNamespace
from ddptrain.resilience import watchdog

watchdog.STORE_SILENT_S, watchdog.STORE_PROBE_S, watchdog.STORE_LOSS_GRACE_S = (1.0, 1.0), 1.0, 0.0
env = SimpleNamespace(rank=1, world_size=2, master_addr="127.0.0.1", master_port=int(sys.argv[1]))
dog = watchdog.Watchdog(env, 5.0, run_dir=None)
dog.calling_since = time.monotonic()  # a round of store calls that never ends
threading.Thread(target=dog._watch_store, daemon=True).start()
time.sleep(60)
"""


@pytest.mark.slow  # two processes, 4-7 s
def test_a_silent_call_is_excused_while_the_store_answers_new_connections_then_the_rank_ends(tmp_path):
    """At 4,096 simulated ranks a process's calls waited more than 10 s for the interpreter's
    lock while the store answered others within 0.3 s, and ranks ended for a store that
    lived. Now a silent call ends the rank when the store does not answer a fresh connection
    either (a frozen host: at once), or after STORE_EXCUSES more windows when it does (this
    process is slow, or its connection is lost): both within bounds, both saying which."""
    import json
    import re
    import socket
    import subprocess
    import sys

    import torch.distributed as dist

    from ddptrain import free_port
    from helpers.commands import clean_env

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)  # noqa: F841 - it answers
    silent = socket.create_server(("127.0.0.1", 0))
    cases = {"lives": port, "frozen": silent.getsockname()[1]}
    try:
        started = time.monotonic()
        ranks = {case: subprocess.Popen([sys.executable, "-c", SILENT_CALL, str(where)], stderr=subprocess.PIPE,
                                        env=clean_env(TORCHELASTIC_ERROR_FILE=str(tmp_path / f"{case}.json")))
                 for case, where in cases.items()}
        ended, printed = {}, {}
        for case, rank in ranks.items():
            printed[case] = rank.communicate(timeout=60)[1].decode()
            assert rank.returncode == 1, printed[case]
            ended[case] = time.monotonic() - started
    finally:
        silent.close()
    said = {case: json.loads((tmp_path / f"{case}.json").read_text())["message"]["message"] for case in cases}
    assert re.search(r"lost the job's store \(a call waited [34] s, though the store answers new connections\): "
                     "this rank's connection to it is broken, or this process is starved of CPU", said["lives"])
    assert "lost the job's store (it did not answer for 1 s, nor a new connection within 1 s)" in said["frozen"]
    assert ended["lives"] < 30 and ended["frozen"] < 30, ended
    assert not any("frame #" in text for text in printed.values()), printed  # no wall of torch's C++ frames
