"""The failure report's choice of the rank to blame, from the ranks' error files' contents."""

from ddptrain.resilience.failures import RankError, original_message, root_cause, short_report, user_frames


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


TORCH = "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py"
CALLSTACK = f'''Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/ddptrain/trainer.py", line 222, in _fit
    ended_by = self._run_epoch(self.progress.epoch)
  File "/home/me/project/my_task.py", line 12, in step
    return model(batch["x"]).sum()
  File "{TORCH}", line 1775, in _call_impl
    return forward_call(*args, **kwargs)
  File "/home/me/project/my_model.py", line 30, in forward
    return self.head(x)
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", line 134, in forward
    return F.linear(input, self.weight, self.bias)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x20 and 21x1)
ddptrain: in step 37
'''


def test_a_users_error_is_its_rank_step_and_message_then_the_users_own_frames():
    error = RankError(1, 0, "RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x20 and 21x1)", CALLSTACK)
    assert short_report(error) == [
        "ddptrain: rank 1 failed in step 37: RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x20 and 21x1)",
        '  /home/me/project/my_task.py:12 in step: return model(batch["x"]).sum()',
        "  /home/me/project/my_model.py:30 in forward: return self.head(x)"]


def test_an_error_from_a_dataloader_worker_is_the_workers_own_line():
    message = ("ValueError: Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent "
               "call last):\n  File \"/home/me/stream.py\", line 9, in __iter__\n    yield bad\n"
               "ValueError: the batch's samples do not fit together: sample 0 of the batch is Tensor[20] float32, "
               "sample 3 is Tensor[21] float32 (RuntimeError: stack expects each tensor to be equal size)")
    assert original_message(message).startswith("ValueError: the batch's samples do not fit together: sample 0")
    assert user_frames(message) == ["/home/me/stream.py:9 in __iter__: yield bad"]


def test_a_rank_that_only_lost_its_peer_is_said_to_have_stopped_never_in_gloos_words():
    from ddptrain.resilience.failures import _what_rank_did

    closed = _error(0, "RuntimeError", "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                    "peer [127.0.0.1]:4242", 1)
    stopped = "rank 0 stopped after rank 1 failed (it lost its connection to it)"
    assert _what_rank_did(0, {0: closed}, cause=1) == stopped
    assert _what_rank_did(2, {}, cause=1) == "rank 2 stopped by the launcher (it had no error of its own)"


def test_at_64_ranks_the_others_are_grouped_by_what_they_did_with_ranges_of_ranks():
    from ddptrain.console import rank_list
    from ddptrain.resilience.failures import _others

    assert rank_list([0, 2, 3]) == "rank 0, 2, 3" and rank_list([0, 1, 3, 4, 5, 9]) == "rank 0, 1, 3-5, 9"
    assert rank_list(list(range(37)) + list(range(38, 64))) == "rank 0-36, 38-63"
    stopped = "PeerFailed: rank {} stopped because rank 37 failed (in all_reduce #11 ([21] float32)): RuntimeError"
    errors = {r: RankError(r, 0, stopped.format(r), "") for r in range(64) if r not in (7, 37)}
    errors[7] = RankError(7, 0, "ValueError: a second failure", "")
    assert _others(64, errors, 37) == ("rank 0-6, 8-36, 38-63 stopped because rank 37 failed (in all_reduce #11 "
                                       "([21] float32)); rank 7: a second failure")
    assert _others(3, errors, 37).count("stopped because") == 3  # a few ranks: one by one, as before


def test_a_killed_rank_torch_did_not_record_is_the_one_without_a_report_among_lost_connections():
    reset = "[gloo/pair.cc:537] Read error [127.0.0.1]:4242: Connection reset by peer"
    errors = {r: _error(r, "RuntimeError", reset, r) for r in range(4) if r != 2}
    assert root_cause(errors, killed={}, nproc=4) == 2
    assert root_cause(errors, killed={}).rank == 0  # without the count: the earliest, as before


def test_a_rank_the_launcher_terminated_is_not_named_for_one_killed_by_another_signal():
    reset = "[gloo/pair.cc:537] Read error [127.0.0.1]:4242: Connection reset by peer"
    errors = {r: _error(r, "RuntimeError", reset, r) for r in range(64) if r not in (10, 37)}
    assert root_cause(errors, killed={10: "SIGTERM", 37: "SIGKILL"}, nproc=64) == 37
    assert root_cause(errors, killed={10: "SIGTERM"}, nproc=64) == 37  # torch missed 37's exit
    assert root_cause({}, killed={10: "SIGTERM"}, nproc=64) == 10  # the only one there is


def test_hard_exit_ends_the_process_even_when_a_sigchld_handler_raises():
    """A DataLoader's SIGCHLD handler raises in the main thread when its worker is killed: the
    rank's exit code and nothing after it (seen: the handler's error replaced the rank's own)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import signal, subprocess, sys, time
        from ddptrain.resilience.failures import hard_exit
        def handler(*_):
            raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")
        signal.signal(signal.SIGCHLD, handler)
        child = subprocess.Popen(["sleep", "30"])
        hard_exit(3)
        print("went on after hard_exit", flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert "went on" not in result.stdout and "RuntimeError" not in result.stderr, result.stderr
