"""The torchft lighthouse lost mid-run (SIGKILLed or frozen) and back on its address, or never
back; an address that is no lighthouse; a group frozen across the lighthouse's restart."""

import os
import re
import signal
import time
from pathlib import Path

import pytest

from ddptrain import free_port
from helpers import ft_groups
from helpers.commands import (
    ForkedCommand,
    assert_same_weights,
    ddptrain_cli,
    descendants,
    finish,
    kill_tree,
    load_model,
    read_metrics,
)
from helpers.ft_groups import group_job, start_lighthouse

pytestmark = pytest.mark.slow


def _lighthouse_lost(tmp_path: Path, frozen: bool, back_after_s: float | None, *options: str, at_loss: int = 20
                     ) -> tuple[list[ForkedCommand], float]:
    """Two groups train; at group 0's ``at_loss``-th loss their lighthouse is SIGKILLed (``frozen``:
    SIGSTOPped, so its connections accept and nothing answers), and ``back_after_s`` later
    started again on its address (``frozen``: SIGCONT; None: never). The groups, and when it went."""
    port, steps = free_port(), tmp_path / "group-0.steps"
    server = start_lighthouse(port, 5000, min_replicas=2)  # (why: the restart test's docstring)
    address = f"http://127.0.0.1:{port}"
    pair = [group_job(address, g, tmp_path / f"group-{g}", "--task", "ft_tasks:kill_paced", "--nproc", "1", *options,
                   STEP_SLEEP="0.05", **({"STEP_LOG": str(steps)} if g == 0 else {})) for g in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while not steps.exists() or len(steps.read_text().split()) < at_loss:
            assert all(p.poll() is None for p in pair) and time.monotonic() < deadline, "the groups stopped"
            time.sleep(0.05)
        if frozen:
            os.kill(server.pid, signal.SIGSTOP)
        else:
            kill_tree(server)
            server.wait(timeout=30)
        lost_at = time.monotonic()
        if back_after_s is not None:
            time.sleep(back_after_s)
            if frozen:
                os.kill(server.pid, signal.SIGCONT)
            else:  # (the killed one's connections still linger)
                server = start_lighthouse(port, 5000, min_replicas=2)
        for process in pair:
            finish(process, 240)
        return pair, lost_at
    finally:
        kill_tree(server)  # (a stopped process dies of SIGKILL too)
        for process in pair:
            kill_tree(process)


DILOCO = ("--sync", "diloco", "--sync-every", "4", "--outer-lr", "0.7", "--outer-momentum", "0.9")


@pytest.mark.parametrize("frozen,sync", [(False, ()), (True, ()), (True, DILOCO)],
                         ids=["killed-and-started-again", "frozen-and-thawed", "frozen-and-thawed-under-diloco"])
def test_a_lighthouse_lost_and_back_on_its_address_is_rejoined_and_both_groups_train_on(tmp_path, frozen, sync):
    """The lighthouse SIGKILLed mid-run, a new one on its address 10 s later: each group says in
    a line that it stopped answering and that it answers again, and both train to the end with
    bitwise equal models (torchft gave up on the quorum at once and then hung for --timeout,
    300 s, ignoring the new lighthouse; `ddptrain lighthouse` refused the address while the
    killed one's connections lingered). The lighthouse wants both groups in every quorum
    (--min-replicas 2): with 1, the group that reaches the new lighthouse first trains alone and
    the other heals from it (the last test here). Frozen (SIGSTOP, its
    machine unreachable) for 10 s instead, it holds the groups' requests unanswered, and answers
    them once thawed: the same two lines, the same weights. Under --sync diloco the groups meet
    there every 4 steps only: frozen between two meetings, they train on to the next and wait
    there for it. Frozen at step 22, between meetings: frozen at step 20, a meeting's, one group
    once waited 10 s without the line (its quorum, it seems, answered just before the freeze: it
    waited for its peer in the meeting's all-reduce, not on the lighthouse)."""
    pair, _ = _lighthouse_lost(tmp_path, frozen, 10.0, "--max-epochs", "2", *sync, at_loss=22 if sync else 20)
    for group, process in enumerate(pair):
        log = (tmp_path / f"group-{group}.log").read_text()
        assert process.returncode == 0, log
        stopped = re.search(r"ddptrain: step (\d+): the lighthouse at \S+ stopped answering; the replica groups "
                            r"wait up to --timeout 300 s", log)
        assert stopped and (int(stopped[1]) % 4 == 1 or not sync), log  # (diloco: the meeting after step 4k)
        # (a frozen one is found silent a few seconds after it froze: its answer's wait is timed)
        after = "([4-9]|1\\d)" if frozen else "(9|1\\d)"
        assert re.search(rf"ddptrain: the lighthouse at \S+ answers again after {after} s; the replica groups train on",
                         log), log
        assert [r["step"] for r in read_metrics(tmp_path / f"group-{group}")] == [64, 128]
    assert_same_weights(load_model(tmp_path / "group-0"), load_model(tmp_path / "group-1"), exact=True)


@pytest.mark.parametrize("frozen", [False, True], ids=["killed", "frozen"])
def test_a_lighthouse_that_never_comes_back_ends_both_groups_in_one_line_after_the_timeout(tmp_path, frozen):
    pair, lost_at = _lighthouse_lost(tmp_path, frozen, None, "--max-epochs", "4", "--timeout", "8")
    assert time.monotonic() - lost_at < 60
    for group, process in enumerate(pair):
        log = (tmp_path / f"group-{group}.log").read_text()
        assert process.returncode == 1, log
        assert "stopped answering; the replica groups wait up to --timeout 8 s" in log, log
        assert re.search(r"^ddptrain: error: the lighthouse at \S+ did not answer for --timeout 8 s; start it "
                         "again on its address", log, re.MULTILINE), log
        assert "Traceback" not in log and "TimeoutError" not in log, log


def test_a_lighthouse_address_that_is_no_lighthouse_is_one_line_before_any_rank_starts(tmp_path):
    """Not a URL; an HTTP server that is something else; a socket that accepts and never answers:
    each one line, exit 2, in seconds (they used to run into --timeout and end in gRPC's error)."""
    import http.server
    import socket
    import threading
    import time

    from ddptrain import ConfigError
    from ddptrain.resilience.lighthouse import check_lighthouse

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # 501 to all
    threading.Thread(target=other.serve_forever, daemon=True).start()
    silent = socket.create_server(("127.0.0.1", 0))  # its backlog accepts; nobody ever reads or answers
    cases = [("not-a-url", "not a lighthouse's address; give http://HOST:PORT"),
             (f"http://127.0.0.1:{other.server_address[1]}", "what answers there is not a torchft lighthouse"),
             (f"http://127.0.0.1:{silent.getsockname()[1]}", "accepts connections there but did not answer within 5 s")]
    try:
        for address, words in cases:
            started = time.monotonic()
            with pytest.raises(ConfigError, match=words):
                check_lighthouse(address)
            assert time.monotonic() - started < 10
        result = ddptrain_cli("train", "--nproc", "1", "--fault-tolerance", "torchft", "--lighthouse", cases[1][0],
                              "--run-dir", str(tmp_path / "run"), timeout=60)  # the real command: the same line
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and cases[1][1] in result.stderr, result.stderr
    finally:
        other.shutdown()
        silent.close()


def _wait_for(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s in vain for {what}"
        time.sleep(0.05)


def test_a_group_frozen_across_a_lighthouse_restart_heals_from_the_group_that_trained_alone(tmp_path):
    """--min-replicas 1 (the default): the lighthouse SIGKILLed; once both groups said so, group 1
    is SIGSTOPped (its machine gone quiet) and a new lighthouse started on the address; group 0
    reaches it alone and trains 10 steps alone; group 1 thawed heals from it at the next quorum,
    and both end bitwise equal. Before, the new lighthouse's second quorum (group 0 alone was its
    first) had the id of the old one's second (the job's start) that group 1 had seen last:
    torchft took it for the same quorum, kept its old process group, and the heal failed in
    PGTransport's recv ("Connection closed by peer") while group 0 waited for group 1 in the new
    group's rendezvous for --timeout (failed 2 runs of 2 before ddptrain renamed the quorums)."""
    port, steps = free_port(), tmp_path / "group-0.steps"
    server = start_lighthouse(port, 3000)
    address = f"http://127.0.0.1:{port}"
    pair = [group_job(address, g, tmp_path / f"group-{g}", "--task", "ft_tasks:paced", "--nproc", "1",
                      "--max-epochs", "2", STEP_SLEEP="0.05", **({"STEP_LOG": str(steps)} if g == 0 else {}))
            for g in (0, 1)]
    logs = [tmp_path / f"group-{g}.log" for g in (0, 1)]
    try:
        _wait_for(lambda: steps.exists() and len(steps.read_text().split()) >= 20, "group 0's 20th loss")
        kill_tree(server)
        server.wait(timeout=30)
        _wait_for(lambda: all("stopped answering" in log.read_text() for log in logs), "both groups' line")
        frozen = [pair[1].pid, *descendants(pair[1].pid)]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        server = start_lighthouse(port, 3000)
        alone_from = len(steps.read_text().split())
        _wait_for(lambda: len(steps.read_text().split()) >= alone_from + 10, "group 0 training alone")
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while any(p.poll() is None for p in pair) and time.monotonic() < deadline:
            time.sleep(0.2)
        for process in pair:
            if process.poll() is None:
                raise AssertionError(ft_groups.stalled(address, process, tmp_path))
            finish(process, 30)
        text = [log.read_text() for log in logs]
        assert [p.returncode for p in pair] == [0, 0], "\n".join(text)
        assert re.search(r"step \d+: replica group 1 left; 1 of 2 groups train on", text[0]), text[0]
        rejoined = r"step \d+: replica group 1 rejoined from a live peer \(2 of 2 groups train\)"
        assert re.search(rejoined, text[1]), text[1]
        for group in (0, 1):
            assert [r["step"] for r in read_metrics(tmp_path / f"group-{group}")] == [64, 128]
        assert_same_weights(load_model(tmp_path / "group-0"), load_model(tmp_path / "group-1"), exact=True)
    finally:
        kill_tree(server)
        for process in pair:
            kill_tree(process)
